#!/usr/bin/env bash
# The FP8 checks of the cast kernels, in one device command on one GPU (6-9 minutes on a fresh H100;
# the CUDA tests autotune every shape, 3-5 minutes of it): the CUDA tests of the FP8 paths, the cast
# kernels' sweep (every tile checked byte by byte, the transposed copy too), and gpt-350m bf16 / FP8 / FP8 with the output gradients cast
# by torch ops (PARATRON_FP8_GRAD_CAST=0), coordinate-descent tuning off in all three (an A/B, not a
# best figure: the tuning adds two to five minutes of warm-up per FP8 variant on a fresh machine).
#   PARATRON_COMMIT=<hash> bash benchmarks/fp8_recheck.sh      # records to $OUT or benchmarks/results
# PARATRON_COMMIT is required: the device copy's git metadata can be stale, and the records name it.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${PARATRON_COMMIT:?pass PARATRON_COMMIT=<the commit being measured>}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PARATRON_COORDINATE_DESCENT=0 PARATRON_COMMIT
out="${OUT:-benchmarks/results}"
stamp="$(date -u +%Y%m%d_%H%M)"
echo "== CUDA tests of the FP8 paths (log: $out/gpu_tests_fp8_$stamp.log)"
timeout 300 python -m pytest -q tests/gpu/test_cuda_paths.py -k "fp8 or cast" > "$out/gpu_tests_fp8_$stamp.log" 2>&1
tail -3 "$out/gpu_tests_fp8_$stamp.log"
echo "== cast kernels, tile by tile"
timeout 150 python benchmarks/fp8_cast_sweep.py --cases "gelu fwd,gelu bwd,swiglu,cast qkv-grad gpt" 2>&1 \
    | grep "^| " | head -5  # one line per case as it finishes: the best checked launch, the autotuner pool's best
echo "== gpt-350m, micro-batch 32 x 2"
fp8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
base="--torch-compile --micro-batch-size 32 --global-batch-size 64"
timeout 330 python benchmarks/train_throughput.py --config gpt-350m --warmup 3 --steps 6 \
    --variant "bf16:$base" --variant "fp8:$base $fp8" --variant "fp8-torch-grad-cast:$base $fp8 PARATRON_FP8_GRAD_CAST=0" \
    2>&1 | grep -E "^\||warm-up|record" | tail -8
