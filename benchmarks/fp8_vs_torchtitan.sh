#!/usr/bin/env bash
# llama-1b FP8 (hybrid, --torch-compile; the delayed recipe with Megatron's guide's history settings, or
# RECIPE=tensorwise) against torchtitan 0.2.2 float8 tensorwise at the same micro-batch (16), in one
# command on one GPU: the side-by-side figure of issue 15.
# Needs .peers/ (a copy of ../shared/bench with torchtitan's wheels; carry it to the device).
#   bash benchmarks/fp8_vs_torchtitan.sh            # records to $OUT or benchmarks/results
# Env: PARATRON_COORDINATE_DESCENT=0 for a quick run (about 2.5 % slower, 25 s instead of 2-4 min warm-up).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-benchmarks/results}"
stamp="$(date -u +%Y%m%d_%H%M)"
VARIANT_TIMEOUT_S=140 TOTAL_BUDGET_S=150 timeout 160 bash .peers/torchtitan/run.sh --variants float8:16 \
    > "$out/torchtitan_float8_mb16_$stamp.log" 2>&1 || echo "torchtitan run failed: see $out/torchtitan_float8_mb16_$stamp.log"
tail -4 "$out/torchtitan_float8_mb16_$stamp.log"
recipe="--fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
[ "${RECIPE:-delayed}" = tensorwise ] && recipe="--fp8-recipe tensorwise"
fp8="--torch-compile --micro-batch-size 16 --fp8-format hybrid $recipe"
timeout 425 python benchmarks/train_throughput.py --config llama-1b \
    --variant "fp8-mb16x4:$fp8 --global-batch-size 64" --variant "fp8-mb16x1:$fp8 --global-batch-size 16" \
    2>&1 | grep -v Warning | tail -6
