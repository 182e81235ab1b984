"""benchmarks/profile_step.py's trace arithmetic: each kernel's exposed share of the critical path when kernels
launched early overlap the one before, and kernels told apart by their launch grid."""
import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def profile_step():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exposed_shares_do_not_overlap_and_sum_to_the_busy_time(profile_step):
    # a: 0-10; b launched early at 2, waits, ends at 14 (4 exposed); c: 14-15 (1); idle 15-20; d: 20-26 (6);
    # e launched early at 22, ends at 30 (4)
    intervals = [(0.0, 10.0, "a"), (2.0, 14.0, "b"), (14.0, 15.0, "c"), (20.0, 26.0, "d"), (22.0, 30.0, "e")]
    shares = profile_step.exposed(intervals)
    assert shares == {"a": 10.0, "b": 4.0, "c": 1.0, "d": 6.0, "e": 4.0}
    _, idle = profile_step.idle_by_neighbours(intervals)
    assert idle == 5.0 and sum(shares.values()) == 30.0 - idle


def test_trace_kernels_names_a_kernel_by_its_grid_when_asked(profile_step, tmp_path):
    events = [{"cat": "kernel", "name": "_row_kernel", "ts": 1.0, "dur": 2.0, "args": {"grid": [512, 1, 1]}},
              {"cat": "kernel", "name": "_row_kernel", "ts": 4.0, "dur": 3.0, "args": {"grid": [4096, 1, 1]}},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 8.0, "dur": 1.0, "args": {}},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 9.0}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert [n for _, _, n in profile_step.trace_kernels(trace)] == ["_row_kernel", "_row_kernel", "Memcpy DtoD"]
    named = profile_step.trace_kernels(trace, grid=True)
    assert named == [(1.0, 3.0, "_row_kernel grid=[512, 1, 1]"), (4.0, 7.0, "_row_kernel grid=[4096, 1, 1]"),
                     (8.0, 9.0, "Memcpy DtoD")]
