"""Multi-token prediction under tensor (+ sequence) and context parallelism equals the one-rank run: losses and every
parameter (the MTP layers' included) after a few training steps, on a DeepSeek-V3-like model (MLA + MoE,
so the MTP layer is an MoE layer too); and a checkpoint saved at TP2 + SP resumes at TP1 x DP2."""
import pytest

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config
from tests.parallel.test_checkpoint_reshard import _train
from tests.parallel.test_pipeline import close

STEPS = 2
MODEL = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
             v_head_dim=6, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2,
             mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
CASES = {"tp2": dict(tensor_model_parallel_size=2),
         "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
         # the shifted tokens cross the CP ranks' chunks; MLA, MoE and the MTP layer's attention under CP too
         "cp2": dict(context_parallel_size=2)}


def _config(world_size=None, **parallel):
    return tiny_config("gpt", world_size, **MODEL, **parallel)


def _ranks(rank, world, root):  # every case in one spawn of the two ranks
    out = {name: run_steps(_config(**parallel), STEPS) for name, parallel in CASES.items()}
    saver = dict(MODEL, tensor_model_parallel_size=2, sequence_parallel=True)
    ref = _train("gpt", saver, False, range(STEPS))
    _train("gpt", saver, False, range(1), save=root)
    out["reshard"] = ref, _train("gpt", MODEL, False, range(1, STEPS), load=root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp")
    return run_ranks(2, _ranks, str(tmp / "ckpt"), tmp_dir=tmp)


def test_mtp_tensor_parallel_equals_single_rank(results):
    ref = run_steps(_config(), STEPS)
    assert any(n.startswith("mtp.layers.1.mtp_model_layer.mlp.experts") for n in ref["params"])
    for name in CASES:
        for result in results:
            assert_close_runs(ref, result[name])


def test_mtp_checkpoint_reshards(results):
    """Saved at TP2 + SP after one step, resumed at TP1 x DP2: the next loss is the saving layout's
    (it would differ if the MTP layers were not saved or loaded: they shape the first step's update)."""
    for ref, resumed in (r["reshard"] for r in results):
        assert all(close(a, b) for a, b in zip(ref[1:], resumed)), (ref, resumed)
