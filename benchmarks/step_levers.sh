#!/usr/bin/env bash
# The device checks of the memory-bound and GEMM-side levers (H100): the CUDA tests of the changed paths (TESTS=1:
# quack's configured GEMMs and the dgated kernel without the activation's store, the fused weight gradients, the
# embedding's fused gradient, the one-pass cross-entropy, the rotary kernels around FlashAttention-4),
# the configured quack GEMMs at the power limit (POWER=1: gemm_power.py --residual and --gated), and llama-1b
# bf16 mb 16 x 4 beside the same with the levers switched back (BEFORE, SINGLES; TRAIN=1),
# beside torchtitan 0.2.2 bf16 at micro-batch 16 (PEER=1). Carry .peers/quack .peers/flash .peers/torchtitan.
#   PARATRON_COMMIT=<hash> TESTS=1 POWER=1 bash benchmarks/step_levers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_run.sh || exit 1
if [ "${TESTS:-0}" = 1 ]; then
    timeout "${TEST_S:-300}" python -m pytest -q tests/gpu/test_grad_accumulation_cuda.py tests/gpu/test_quack_kernels_cuda.py \
        tests/gpu/test_cross_entropy_cuda.py tests/gpu/test_rope_flash_cuda.py tests/gpu/test_flash_attention_cuda.py \
        ${EXTRA_TESTS:-} 2>&1 | grep -v Warn | tee "$out/gpu_tests_levers_$stamp.log" | tail -12
fi
if [ "${POWER:-0}" = 1 ]; then  # kernels at the power limit
    for mode in residual gated; do
        timeout 200 python benchmarks/gemm_power.py --$mode --seconds "${POWER_S:-1.5}" --warm 0.75 2>&1 | grep -v Warn \
            > "$out/gemm_power_${mode}_$stamp.md"
        cat "$out/gemm_power_${mode}_$stamp.md" | tail -n +4 | cut -c1-110
    done
fi
if [ "${TRAIN:-0}" = 1 ]; then
    bf16="--torch-compile --micro-batch-size 16 --global-batch-size 64"
    # BEFORE: the environment of the "as before" variant (default: the twelfth session's passes switched back;
    # empty: no such variant). Each variant runs in its own process (train_throughput.py), so that switches
    # read at import apply.
    old="${BEFORE-PARATRON_QUACK_TILES=residual=off,dgated=default,dx=off,wgrad_fc1=off,wgrad_fc2=off PARATRON_KEEP_SWIGLU_ACT=0 PARATRON_FUSED_ROPE=0 PARATRON_FUSED_CE=0}"
    variants=(--variant "bf16:$bf16")
    [ -n "$old" ] && variants+=(--variant "bf16-as-before:$bf16 $old")
    # SINGLES="rope-off=PARATRON_FUSED_ROPE=0;ce-off=PARATRON_FUSED_CE=0": one more variant per name=environment
    IFS=';' read -ra singles <<< "${SINGLES:-}"
    for one in "${singles[@]}"; do variants+=(--variant "bf16-${one%%=*}:$bf16 ${one#*=}"); done
    timeout "${TRAIN_S:-420}" python benchmarks/train_throughput.py --config llama-1b "${variants[@]}" 2>&1 \
        | grep -v "Warn\|warn" | tail -8
fi
if [ "${PEER:-0}" = 1 ]; then
    VARIANT_TIMEOUT_S=140 TOTAL_BUDGET_S=150 timeout 160 bash .peers/torchtitan/run.sh --variants bf16:16 \
        > "$out/torchtitan_bf16_mb16_$stamp.log" 2>&1 || echo "torchtitan run failed: see $out/torchtitan_bf16_mb16_$stamp.log"
    tail -4 "$out/torchtitan_bf16_mb16_$stamp.log"
fi
