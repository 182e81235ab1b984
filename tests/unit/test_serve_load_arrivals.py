"""benchmarks/serve_load.py's in-process arrivals (``--engines offline --rate R``): requests join the paged engine
between steps at their arrival times; every token is timed once, TTFT from the arrival."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.sampling import SamplingParams
from tests.threads import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.unit.test_generate import VOCAB, tiny_model
from tests.unit.test_paged_engine import config

ROOT = Path(__file__).resolve().parents[2]


def test_arrivals_time_every_token_of_every_request_from_its_arrival():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engine = PagedEngine(Engine(tiny_model(), VOCAB), config())
    news = [3, 5, 1, 4, 2, 6]
    requests = [Request([1 + i, 2, 3], SamplingParams(max_new_tokens=n, ignore_eod=True)) for i, n in enumerate(news)]
    times = [0.0, 0.0, 0.05, 0.1, 0.1, 0.3]  # the last arrives after the others are done: the engine waits idle
    start = time.perf_counter()
    out = bench.arrivals(engine, times, requests)
    assert time.perf_counter() - start >= 0.3
    assert out["output_tokens"] == sum(news) and len(out["ttft"]) == len(out["e2e"]) == len(news)
    assert len(out["itl"]) == sum(news) - len(news)  # a gap between consecutive tokens only (no end marker)
    assert all(0 <= t < 5 for t in out["ttft"]) and all(e >= t for e, t in zip(out["e2e"], out["ttft"]))
    assert out["wall_s"] >= 0.3 and engine.idle


def test_profile_reads_paratron_python_time_from_the_trace_once_per_nesting(tmp_path):
    """``--profile``'s host table: each paratron function's time per the trace's Python events, its calls included,
    a recursive (nested) call not counted twice; other code left out."""
    import json
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    step, pack = "paratron/inference/paged.py(210): step", "paratron/inference/paged.py(267): _pack"
    events = [{"cat": "python_function", "name": step, "ts": 0, "dur": 100},
              {"cat": "python_function", "name": pack, "ts": 10, "dur": 30},
              {"cat": "python_function", "name": pack, "ts": 15, "dur": 10},  # (nested in the one above)
              {"cat": "python_function", "name": step, "ts": 200, "dur": 50},
              {"cat": "python_function", "name": "torch/nn/modules/module.py(1): _call_impl", "ts": 0, "dur": 9},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    assert bench.python_time(tmp_path / "t.json") == {step: 150.0, pack: 30.0}
