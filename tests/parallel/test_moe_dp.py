"""An MoE model at DP 2 (gloo) equals one rank within 1e-5: expert gradients are reduced over the
expert-data-parallel group (= the data-parallel group at EP 1), the aux losses' gradients are scaled
as the main loss's, and the expert bias sees the token counts of every data-parallel rank."""
from __future__ import annotations

import pytest

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 3
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2, moe_grouped_gemm=True,
           moe_router_dtype="fp32")
VARIANTS = {"plain": {}, "distopt": {"use_distributed_optimizer": True},
            "seq_aux": {"moe_router_load_balancing_type": "seq_aux_loss", "moe_layer_freq": "[0,1]"}}


def _experts_in_edp(model) -> bool:
    from paratron.parallel.sharding import spec_of
    return all(spec_of(p).grad_group == "edp" for n, p in model.named_parameters() if ".experts." in n)


def _run(rank, world):
    return {name: run_steps(tiny_config("llama", world, **MOE, **extra), STEPS) for name, extra in VARIANTS.items()}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_ranks(2, _run, tmp_dir=tmp_path_factory.mktemp("moe_dp2"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dp2_equals_one_rank(dp2, variant):
    ref = run_steps(tiny_config("llama", 1, **MOE, **VARIANTS[variant]), STEPS)
    for rank in range(2):
        assert_close_runs(ref, dp2[rank][variant])
    assert ref["losses"][-1] != ref["losses"][0]


def test_expert_weights_reduce_over_edp():
    from paratron.model.gpt import GPTModel
    cfg = tiny_config("llama", 1, **MOE)
    assert _experts_in_edp(GPTModel(cfg.model, 512))
