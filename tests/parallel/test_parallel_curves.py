"""benchmarks/parallel_curves.py on CPU/gloo: --concurrent starts the one-process runs together and the
several-process run after them; --compare reports a TP2 run's loss difference from one rank (fp32 on a
CPU: equal within rounding) and the record carries every run's curve."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.parallel.cli import ROOT


@pytest.mark.slow  # (16 s of concurrent runs)
def test_concurrent_runs_and_compare_table(tmp_path):
    base = "--config tiny --train-iters 3 --device cpu --eval-iters 0"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "parallel_curves.py"), "--concurrent", "--base", base,
           "--run", "one:1:", "--run", "tp2:2:--tensor-model-parallel-size 2 --sequence-parallel",
           "--run", "lr:1:--lr 5e-3", "--compare", "tp2:one", "--compare", "lr:one",
           "--record-dir", str(tmp_path), "--tag", "curves"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name in ("one", "tp2", "lr"):
        assert re.search(rf"^{name}: rc 0, 3 logged steps", r.stdout, re.M), r.stdout
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^\| (\w+) \| one \| ([0-9.e+-]+) \| [0-9.e+-]+ \| 3 \|$", r.stdout, re.M)}
    assert set(rows) == {"tp2", "lr"}, r.stdout
    assert rows["tp2"] < 1e-5  # TP2 + SP is the one-rank run
    assert rows["lr"] > 1e-4  # another learning rate is another curve: the comparison can tell
    records = list(tmp_path.glob("curves_*.md"))
    assert len(records) == 1 and "Loss per step" in records[0].read_text()
