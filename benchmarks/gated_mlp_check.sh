#!/usr/bin/env bash
# The gated-GEMM SwiGLU MLP (quack-kernels) on the device, in one command: quack's CUDA tests, the
# one-layer MLP / RMSNorm / fp32 weight-gradient probe, llama-1b bf16 training with and without quack's
# gated GEMMs and RMSNorm, and torchtitan 0.2.2 bf16 at the same micro-batch (16) for the side-by-side ratio.
# The device has no internet: quack and its CUDA-DSL runtime travel as .peers/quack/site.tar.xz
# (`pip install --no-deps --target site quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2
# nvidia-cutlass-dsl-libs-base==4.4.2 apache-tvm-ffi torch-c-dlpack-ext einops` for Python 3.12,
# tar + xz -9e: ~52 MB; the wheel itself is 74 MB, over the carry limit), unpacked by quack_env.sh.
#   PARATRON_COMMIT=<hash> bash benchmarks/gated_mlp_check.sh     (carry .peers/quack .peers/torchtitan)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
. benchmarks/quack_env.sh || exit 1
export PARATRON_COORDINATE_DESCENT=${PARATRON_COORDINATE_DESCENT:-0}
timeout "${TEST_S:-150}" python -m pytest -q -x tests/gpu/test_quack_kernels_cuda.py 2>&1 | tail -15
[ "${PROBE:-1}" = 1 ] && timeout "${PROBE_S:-150}" python benchmarks/gated_mlp_bench.py --config llama-1b \
    --tokens 32768 2>&1 | grep -v Warning | tail -30
bf16="--torch-compile --micro-batch-size 16 --global-batch-size 64"
timeout "${TRAIN_S:-240}" python benchmarks/train_throughput.py --config llama-1b \
    --variant "bf16-plain:$bf16 PARATRON_GATED_GEMM=0 PARATRON_QUACK_NORM=0" \
    --variant "bf16-quack:$bf16" --variant "bf16-gated-only:$bf16 PARATRON_QUACK_NORM=0" \
    --variant "bf16-quack-bwd-quack:$bf16 PARATRON_GATED_BWD=quack" 2>&1 | grep -v Warning | tail -8
if [ -d .peers/torchtitan ] && [ "${TORCHTITAN:-1}" = 1 ]; then
    stamp="$(date -u +%Y%m%d_%H%M)"
    VARIANT_TIMEOUT_S=140 TOTAL_BUDGET_S=150 timeout 160 bash .peers/torchtitan/run.sh --variants bf16:16 \
        > "$out/torchtitan_bf16_mb16_$stamp.log" 2>&1 || echo "torchtitan run failed: see $out/torchtitan_bf16_mb16_$stamp.log"
    tail -4 "$out/torchtitan_bf16_mb16_$stamp.log"
fi
