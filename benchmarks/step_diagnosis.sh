#!/usr/bin/env bash
# Why do the step's GEMMs run slower than alone? The SM clock, power and temperature, sampled every 100 ms
# by nvidia-smi while (1) one llama-1b layer's GEMMs run back to back (gemm_sustained.py), (2) each linear
# layer's GEMMs run alone (matmul_shapes.py) and (3) llama-1b bf16 trains (mb 16 x 4); a table of the
# median / min clock and power per phase. Then (4) a profile of the step naming the CPU operators (with
# shapes) behind its copies and cuBLAS kernels. Carry .peers/quack .peers/flash.
#   PARATRON_COMMIT=<hash> bash benchmarks/step_diagnosis.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_run.sh || exit 1
smi="$out/clocks_$stamp.csv" phases="$out/clock_phases_$stamp.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 100 > "$smi" 2>&1 &
sampler=$!
phase() { echo "$(date -u '+%Y/%m/%d %H:%M:%S.%3N') $1" >> "$phases"; }
bf16="--torch-compile --micro-batch-size 16"
phase idle; sleep 2
phase gemm_sustained; timeout 60 python benchmarks/gemm_sustained.py --seconds 10 2>&1 | tee "$out/gemm_sustained_$stamp.txt" | tail -4
phase matmul_shapes; timeout 150 python benchmarks/matmul_shapes.py > "$out/matmul_shapes_$stamp.txt" 2>&1; tail -3 "$out/matmul_shapes_$stamp.txt"
phase train_compile; timeout 240 python benchmarks/train_throughput.py --config llama-1b --steps 30 \
    --variant "bf16:$bf16 --global-batch-size 64" 2>&1 | grep -v Warn | tail -3
phase profile; PROFILE_ORIGIN='Memcpy|direct_copy|Fill|nvjet|elementwise' PROFILE_ORIGIN_TOP=60 timeout 240 \
    python benchmarks/profile_step.py --config llama-1b $bf16 --global-batch-size 32 > "$out/profile_origins_$stamp.txt" 2>&1
grep -A12 "step wall" "$out/profile_origins_$stamp.txt"
phase end; kill $sampler
python - "$smi" "$phases" <<'PY' | tee -a "$phases"
import sys, statistics
from datetime import datetime
fmt = "%Y/%m/%d %H:%M:%S.%f"
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((datetime.strptime(f[0], fmt), float(f[1]), float(f[2]), float(f[3]), f[4]))
    except (ValueError, IndexError):
        continue
marks = [(datetime.strptime(l[:23], fmt), l[24:].strip()) for l in open(sys.argv[2])]
print(f"{'phase':16s} {'samples':>7s} {'SM MHz med':>10s} {'min':>6s} {'W med':>7s} {'max':>6s} {'C max':>6s}  throttle reasons")
for (t0, name), (t1, _) in zip(marks, marks[1:]):
    r = [x for x in rows if t0 <= x[0] < t1]
    if r:
        c, w = [x[1] for x in r], [x[2] for x in r]
        reasons = sorted({x[4] for x in r})
        print(f"{name:16s} {len(r):7d} {statistics.median(c):10.0f} {min(c):6.0f} {statistics.median(w):7.0f} "
              f"{max(w):6.0f} {max(x[3] for x in r):6.0f}  {' '.join(reasons)[:60]}")
PY
