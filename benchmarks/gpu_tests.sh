#!/usr/bin/env bash
# tests/gpu in two halves that each fit one device call (the whole suite runs past the 600 s limit of a call
# on one H100: at 0553cb0 pytest had passed 71 of 93 tests at 560 s). Writes $OUT/gpu_tests_part<N>_<stamp>.log
# (unbuffered, so a call stopped by its limit still returns what ran). Carry .peers/quack .peers/flash.
#   PARATRON_COMMIT=<hash> PART=1 bash benchmarks/gpu_tests.sh     # then PART=2 in a second call
set -uo pipefail
cd "$(dirname "$0")/.."
files=(tests/gpu/test_*.py)
half=$(( (${#files[@]} + 1) / 2 ))
case "${PART:-1}" in
    1) chosen=("${files[@]:0:$half}") ;;
    2) chosen=("${files[@]:$half}") ;;
    *) echo "PART must be 1 or 2, got '${PART}'" >&2; exit 2 ;;
esac
. benchmarks/device_run.sh || exit 1
echo "part ${PART:-1}: ${chosen[*]}"
# (warnings off: the kernel libraries' deprecation warnings drown the report, and a filter on "warn" would drop
# pytest's summary line, which counts them)
timeout "${TEST_S:-560}" python -u -W ignore -m pytest -q -rf -p no:cacheprovider -p no:warnings "${chosen[@]}" 2>&1 \
    | tee "$out/gpu_tests_part${PART:-1}_$stamp.log" | tail -15
