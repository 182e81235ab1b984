#!/usr/bin/env bash
# torchtitan 0.2.2 at micro-batch 16 with gradient accumulation to a global batch of TT_GLOBAL_BATCH sequences
# (default 64: one optimizer step per 4 micro-batches, as paratron's benchmark runs), beside the harness's own
# run (global batch = micro-batch: an optimizer step per micro-batch). The carried harness
# (.peers/torchtitan = ../shared/bench/torchtitan) passes only the micro-batch: a copy of it in /tmp gets
# torchtitan's own --training.global_batch_size and counts the step's tokens from it. Carry .peers/torchtitan.
#   TT_GLOBAL_BATCH=64 bash benchmarks/torchtitan_accum.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
gb="${TT_GLOBAL_BATCH:-64}"
copy=/tmp/tt_accum
rm -rf "$copy" && cp -r .peers/torchtitan "$copy" || exit 1
python3 - "$copy/bench_torchtitan.py" "$gb" <<'PY' || exit 1
import sys
path, gb = sys.argv[1], sys.argv[2]
s = open(path).read()
old_args = '"--training.local_batch_size", str(a.mb),'
old_tok = "tok = a.mb * a.seq"
assert old_args in s and old_tok in s, "the harness changed: patch it by hand"
s = s.replace(old_args, old_args + f' "--training.global_batch_size", "{gb}",')
s = s.replace(old_tok, f"tok = {gb} * a.seq  # the global batch's tokens per optimizer step")
open(path, "w").write(s)
PY
log="$out/torchtitan_bf16_mb16_gb${gb}_$(date -u +%Y%m%d_%H%M).log"
VARIANT_TIMEOUT_S=200 TOTAL_BUDGET_S=210 timeout 220 bash "$copy/run.sh" --variants bf16:16 > "$log" 2>&1
tail -4 "$log"
