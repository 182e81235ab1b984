#!/usr/bin/env bash
# FlashAttention-4 and the residual-keeping norms on the device, in one command: their CUDA tests, the
# attention kernels alone (SDPA vs FlashAttention-4), and llama-1b bf16 training with and without
# FlashAttention-4 (PARATRON_FLASH_ATTN=0: SDPA). flash-attn-4 4.0.0b10 (the newest whose requirements
# match quack-kernels 0.3.11 and nvidia-cutlass-dsl 4.4.2) travels as .peers/flash/*.whl; quack_env.sh
# unpacks it beside quack.
#   PARATRON_COMMIT=<hash> bash benchmarks/flash_check.sh        (carry .peers/quack .peers/flash)
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/quack_env.sh || exit 1
export PARATRON_COORDINATE_DESCENT=${PARATRON_COORDINATE_DESCENT:-0} PYTHONUNBUFFERED=1
timeout "${TEST_S:-200}" python -m pytest -q -x tests/gpu/test_flash_attention_cuda.py \
    tests/gpu/test_quack_kernels_cuda.py 2>&1 | grep -v Warning | tail -15
timeout "${BENCH_S:-90}" python benchmarks/flash_attention_bench.py 2>&1 | grep -v Warning | tail -12
bf16="--torch-compile --micro-batch-size 16 --global-batch-size 64"
timeout "${TRAIN_S:-240}" python benchmarks/train_throughput.py --config llama-1b \
    --variant "bf16-sdpa:$bf16 PARATRON_FLASH_ATTN=0" --variant "bf16-flash4:$bf16" 2>&1 | grep -v Warning | tail -6
