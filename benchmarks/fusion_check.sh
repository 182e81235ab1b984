#!/usr/bin/env bash
# The eleventh session's device checks in one command (H100): the CUDA tests of the changed paths (gradient-
# accumulation fusion, FlashAttention-4, quack's kernels, the CUDA optimizer / checkpoint paths; TESTS=0
# skips), Inductor's generated code for one llama-1b layer's compiled forward + backward (CODE=1; the kernels
# the profile names, with their sources), and llama-1b bf16 mb 16 x 4 with and without the fusion beside
# torchtitan 0.2.2 bf16 at micro-batch 16 (TRAIN=1); quack's gated GEMMs per configuration (GATED=1). Carry .peers/quack .peers/flash .peers/torchtitan.
#   PARATRON_COMMIT=<hash> TRAIN=1 bash benchmarks/fusion_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_run.sh || exit 1
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_S:-420}" python -m pytest -q tests/gpu/test_grad_accumulation_cuda.py tests/gpu/test_quack_kernels_cuda.py \
        tests/gpu/test_flash_attention_cuda.py tests/gpu/test_cuda_paths.py ${EXTRA_TESTS:-} 2>&1 | grep -v Warn \
        | tee "$out/gpu_tests_fusion_$stamp.log" | tail -8
fi
if [ "${CODE:-0}" = 1 ]; then
    TORCH_LOGS=output_code timeout 200 python - > "$out/inductor_code_llama-1b_layer_$stamp.txt" 2>&1 <<'PY'
from paratron.config import parse_args
from paratron.train.loop import Trainer
t = Trainer(parse_args(["--config", "llama-1b", "--num-layers", "1", "--micro-batch-size", "16", "--global-batch-size", "16",
                        "--torch-compile", "--mock-data", "--train-iters", "2", "--eval-iters", "0"]))
t.train_step()
t.close()
PY
    grep -o "triton_[a-z]*_fused_[A-Za-z0-9_]*" "$out/inductor_code_llama-1b_layer_$stamp.txt" | sort | uniq -c | sort -rn | head -30
fi
if [ "${GATED:-0}" = 1 ]; then  # quack's gated MLP GEMMs per tile configuration, at the power limit
    timeout 240 python benchmarks/gemm_power.py --gated --seconds 2 --warm 1 2>&1 | grep -v Warn \
        | tee "$out/gemm_power_gated_$stamp.md" | tail -14
fi
if [ "${TRAIN:-0}" = 1 ]; then
    bf16="--torch-compile --micro-batch-size 16 --global-batch-size 64"
    timeout "${TRAIN_S:-330}" python benchmarks/train_throughput.py --config llama-1b --variant "bf16:$bf16" \
        --variant "bf16-unfused-wgrad:$bf16 --no-gradient-accumulation-fusion" ${MORE_VARIANTS:-} 2>&1 | grep -v Warn | tail -6
    VARIANT_TIMEOUT_S=140 TOTAL_BUDGET_S=150 timeout 160 bash .peers/torchtitan/run.sh --variants bf16:16 \
        > "$out/torchtitan_bf16_mb16_$stamp.log" 2>&1 || echo "torchtitan run failed: see $out/torchtitan_bf16_mb16_$stamp.log"
    tail -4 "$out/torchtitan_bf16_mb16_$stamp.log"
fi
