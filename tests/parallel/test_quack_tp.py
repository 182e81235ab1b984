"""The gated-GEMM MLP's wiring under TP + SP on CPU/gloo: with quack's kernels replaced by their torch
references (the same interleaved layout), TP2 + SP training equals the plain one-rank run, so fc1's
gathered input, fc2's partial sum reduced after the fused function and the residual added after the
reduction are right. The kernels themselves run in tests/gpu."""
from paratron.kernels import quack_mlp as quack_kernels
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 3


def _force_gated(calls: list):
    quack_kernels.wanted = lambda *a: "cublas"

    def applies(*a):
        calls.append(1)
        return True
    quack_kernels.applies = applies


def _rank(rank, world):
    calls = []
    _force_gated(calls)
    out = run_steps(tiny_config("llama", tensor_model_parallel_size=world, sequence_parallel=True,
                                kernel_gated_mlp="quack"), STEPS)  # asked: "auto" finds no quack on a CPU
    out["gated_calls"] = len(calls)
    return out


def test_tp2_sp_gated_mlp_equals_plain_single_rank(tmp_path):
    ref = run_steps(tiny_config("llama", world_size=1), STEPS)
    for r in run_ranks(2, _rank, tmp_dir=tmp_path):
        assert r["gated_calls"] > 0
        assert_close_runs(ref, r)
