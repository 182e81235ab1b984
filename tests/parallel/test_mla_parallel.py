"""Multi-latent attention under tensor (+ sequence), context and pipeline parallelism equals the one-rank run:
losses and every parameter after a few training steps (heads split over TP, the down projections and
the latent norms replicated)."""
import pytest

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config
from tests.parallel.test_checkpoint_reshard import _train
from tests.parallel.test_pipeline import close, run_case

STEPS = 2
MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           qk_layernorm=True, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
           rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707, untie_embeddings_and_output_weights=True)


def _config(q_lora_rank, world_size=None, **parallel):
    return tiny_config("gpt", world_size, **MLA, q_lora_rank=q_lora_rank, **parallel)


CASES = {"tp2": (24, dict(tensor_model_parallel_size=2)),
            "tp2-sp": (24, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
            "tp2-sp-plain-q": (None, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
            "cp2-ring": (24, dict(context_parallel_size=2)),
            "cp2-a2a-plain-q": (None, dict(context_parallel_size=2, cp_comm_type="a2a"))}


def _tp_ranks(rank, world, root):  # every case in one spawn of the two ranks
    out = {name: run_steps(_config(q, **parallel), STEPS) for name, (q, parallel) in CASES.items()}
    out["reshard"] = _reshard(root)
    return out


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    return run_ranks(2, _tp_ranks, str(tmp / "ckpt"), tmp_dir=tmp)


@pytest.mark.parametrize("name", list(CASES))
def test_mla_layout_equals_single_rank(name, tp_results):
    ref = run_steps(_config(CASES[name][0]), STEPS)
    for result in tp_results:
        assert_close_runs(ref, result[name])


def _pp_rank(rank, world, settings):
    return run_case("gpt", settings)


def test_mla_pipeline_equals_single_rank(tmp_path):
    """PP2 (4 layers, 8 micro-batches per step, the attention core recomputed): the last stage's losses
    and both stages' parameters equal the one-rank run's."""
    settings = dict(MLA, q_lora_rank=24, recompute_activations=True)
    ref = run_case("gpt", settings)
    ranks = run_ranks(2, _pp_rank, dict(settings, pipeline_model_parallel_size=2), tmp_dir=tmp_path)
    last = next(r for r in ranks if r["last_stage"])
    assert all(close(a, b) for a, b in zip(ref["losses"], last["losses"])), (ref["losses"], last["losses"])
    merged = {n: p for r in ranks for n, p in r["params"].items()}
    assert merged.keys() == ref["params"].keys()
    for n, a in ref["params"].items():
        assert ((a - merged[n]).norm() / a.norm()).item() <= 1e-5, n


def _reshard(root):
    """test_checkpoint_reshard's runs with MLA: saved at TP2 + SP after one step, resumed at TP1 x DP2."""
    mla = dict(MLA, q_lora_rank=24)
    saver = dict(mla, tensor_model_parallel_size=2, sequence_parallel=True)
    ref = _train("gpt", saver, False, range(STEPS))
    _train("gpt", saver, False, range(1), save=root)
    return ref, _train("gpt", mla, False, range(1, STEPS), load=root)


def test_mla_checkpoint_reshards(tp_results):
    """Saved at TP2 + SP after one step, resumed at TP1 x DP2: the next loss is the saving layout's."""
    for ref, resumed in (r["reshard"] for r in tp_results):
        assert all(close(a, b) for a, b in zip(ref[1:], resumed)), (ref, resumed)
