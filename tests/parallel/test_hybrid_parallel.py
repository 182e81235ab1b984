"""Hybrid stacks (Mamba-2, Gated DeltaNet, attention and MLP layers) under tensor (+ sequence), data (with the
distributed optimizer) and pipeline parallelism equal the one-rank run: losses and every parameter after 3
training steps (Mamba-2 heads and groups, DeltaNet key heads with their value heads split over TP; the
convolutions and the gated norms per rank). A checkpoint saved at TP2 + SP resumes at TP1 x DP2. Context
parallelism: test_hybrid_cp.py."""
import pytest

from paratron.config import ConfigError
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config
from tests.parallel.test_checkpoint_reshard import _train
from tests.parallel.test_pipeline import close, run_case

STEPS = 3
HYBRID = dict(hybrid_layer_pattern="MG*-", normalization="RMSNorm", position_embedding_type="none",
              disable_bias_linear=True, mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2,
              mamba_chunk_size=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4)
CASES = {"tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
         "dp2-distopt": dict(use_distributed_optimizer=True)}


def _ranks(rank, world, root):  # every case in one spawn of the two ranks
    out = {name: run_steps(tiny_config("gpt", **HYBRID, **parallel), STEPS) for name, parallel in CASES.items()}
    saver = dict(HYBRID, tensor_model_parallel_size=2, sequence_parallel=True)
    _train("gpt", saver, False, range(1), save=root)
    out["reshard"] = (_train("gpt", saver, False, range(STEPS)), _train("gpt", HYBRID, True, range(1, STEPS),
                                                                        load=root))
    out["pp2"] = run_case("gpt", dict(HYBRID, hybrid_layer_pattern="MG|*-", pipeline_model_parallel_size=2,
                                      recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    return out


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    return run_steps(tiny_config("gpt", **HYBRID), STEPS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    return run_ranks(2, _ranks, str(tmp / "ckpt"), tmp_dir=tmp)


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_layout_equals_single_rank(name, results, reference):
    for result in results:
        assert_close_runs(reference, result[name])


def test_hybrid_pipeline_split_by_the_pattern(results):
    """'MG|*-' on PP2 (with full recomputation): stage 0 holds the Mamba-2 and DeltaNet layers, stage 1 attention
    and the MLP."""
    ref = run_case("gpt", HYBRID)
    last = next(r for r in results if r["pp2"]["last_stage"])["pp2"]
    assert all(close(a, b) for a, b in zip(ref["losses"], last["losses"])), (ref["losses"], last["losses"])
    merged = {n: p for r in results for n, p in r["pp2"]["params"].items()
              if n in ref["params"] or n != "output_layer.weight"}  # (not the last stage's copy of the embedding)
    assert any(".self_attention.A_log" in n for n in results[0]["pp2"]["params"])  # the first stage's mixers
    assert merged.keys() == ref["params"].keys()
    for n, a in ref["params"].items():
        assert ((a - merged[n]).norm() / a.norm()).item() <= 1e-5, n


def test_hybrid_checkpoint_reshards(results):
    for ref, resumed in (r["reshard"] for r in results):
        assert all(close(a, b) for a, b in zip(ref[1:], resumed)), (ref, resumed)


@pytest.mark.parametrize("kw,match", [
    (dict(mamba_num_groups=2, tensor_model_parallel_size=2), "--mamba-num-groups 2 must both be divisible by "
     "--tensor-model-parallel-size 2 x --context-parallel-size 2"),
    (dict(linear_num_key_heads=1), "--linear-num-key-heads 1 is not divisible by "
     "--tensor-model-parallel-size 1 x --context-parallel-size 2"),
])
def test_context_parallel_needs_heads_divisible_by_tp_x_cp(kw, match):
    """CP hands each rank 1/CP of a TP rank's Mamba-2 heads and groups (DeltaNet key heads): test_hybrid_cp.py."""
    tiny_config("gpt", 2, **HYBRID, context_parallel_size=2)  # 8 heads, 2 groups, 2 key heads: CP 2 fits
    with pytest.raises(ConfigError, match=match):
        tiny_config("gpt", 4, **{**HYBRID, "context_parallel_size": 2, **kw})
