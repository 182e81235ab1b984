#!/usr/bin/env bash
# FlashAttention-4, the residual-keeping norms and the gradient-accumulation kernel on the device, in one
# command: their CUDA tests (TESTS=0 skips), the attention kernels alone (SDPA vs FlashAttention-4;
# BENCH=0 skips), llama-1b bf16 training with everything on, with SDPA (PARATRON_FLASH_ATTN=0) and with
# torch's accumulation (PARATRON_FUSED_ACCUMULATE=0), and torchtitan 0.2.2 bf16 at the same micro-batch
# (16) for the side-by-side ratio (TORCHTITAN=0 skips). flash-attn-4 4.0.0b10 (the newest whose
# requirements match quack-kernels 0.3.11 and nvidia-cutlass-dsl 4.4.2) travels as .peers/flash/*.whl;
# quack_env.sh unpacks it beside quack.
#   PARATRON_COMMIT=<hash> bash benchmarks/flash_check.sh     (carry .peers/quack .peers/flash .peers/torchtitan)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
. benchmarks/quack_env.sh || exit 1
export PARATRON_COORDINATE_DESCENT=${PARATRON_COORDINATE_DESCENT:-0} PYTHONUNBUFFERED=1
[ "${TESTS:-1}" = 1 ] && timeout "${TEST_S:-200}" python -m pytest -q -x tests/gpu/test_flash_attention_cuda.py \
    tests/gpu/test_quack_kernels_cuda.py 2>&1 | grep -v Warning | tail -15
[ "${BENCH:-1}" = 1 ] && timeout "${BENCH_S:-90}" python benchmarks/flash_attention_bench.py 2>&1 | grep -v Warning | tail -12
bf16="--torch-compile --micro-batch-size 16 --global-batch-size 64"
timeout "${TRAIN_S:-330}" python benchmarks/train_throughput.py --config llama-1b --variant "bf16:$bf16" \
    --variant "bf16-sdpa:$bf16 PARATRON_FLASH_ATTN=0" --variant "bf16-torch-accumulate:$bf16 PARATRON_FUSED_ACCUMULATE=0" \
    2>&1 | grep -v Warning | tail -6
if [ -d .peers/torchtitan ] && [ "${TORCHTITAN:-1}" = 1 ]; then
    stamp="$(date -u +%Y%m%d_%H%M)"
    VARIANT_TIMEOUT_S=140 TOTAL_BUDGET_S=150 timeout 160 bash .peers/torchtitan/run.sh --variants bf16:16 \
        > "$out/torchtitan_bf16_mb16_$stamp.log" 2>&1 || echo "torchtitan run failed: see $out/torchtitan_bf16_mb16_$stamp.log"
    tail -4 "$out/torchtitan_bf16_mb16_$stamp.log"
fi
