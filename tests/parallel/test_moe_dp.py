"""An MoE model at DP 2 and PP 2 (gloo) equals one rank within 1e-5: expert gradients are reduced over
the expert-data-parallel group (= the data-parallel group at EP 1), the aux losses' gradients are
scaled as the main loss's (and flow back through a pipeline stage boundary), and the expert bias sees
the token counts of every data-parallel rank."""
from __future__ import annotations

import pytest
import torch

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


def _run(rank, world, ckpt_dir):
    out = {name: run_steps(tiny_config("llama", world, **MOE, **extra), STEPS) for name, extra in VARIANTS.items()}
    out["pp2"] = _pipeline(tiny_config("llama", world, **MOE, pipeline_model_parallel_size=2))
    from tests.parallel.test_data_parallel import train
    # saved at DP 2 with the distributed optimizer after STEPS - 1 steps, resumed on one rank below
    train(tiny_config("llama", world, **MOE, use_distributed_optimizer=True, save=ckpt_dir), STEPS,
          save_after=STEPS - 1)
    return out


def _pipeline(cfg) -> dict:
    """STEPS steps of a pipeline run: the last stage's losses, this stage's parameters by global name
    (gathered over the groups they are split over: TP, EP, expert-TP)."""
    from paratron.parallel.stages import global_named_parameters
    from paratron.parallel.tensor import gather_global
    from paratron.train.loop import Trainer, build_dims
    from tests.parallel.common import global_batches, micro_batches
    dims = build_dims(cfg)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims,
                      data=(micro_batches(global_batches(cfg, STEPS), cfg, dims.dp_rank, dims.dp), None))
    losses = []
    for _ in range(STEPS):
        report, _, _ = trainer.train_step()
        losses.append((report[0] / report[1].clamp(min=1)).item())
    params = {n: gather_global(p, dims).clone() for n, p in global_named_parameters(trainer.models).items()}
    trainer.close()
    return {"losses": losses if dims.is_last_stage else None, "params": params}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_dp2")
    return run_ranks(2, _run, str(tmp / "ckpt"), tmp_dir=tmp) + [str(tmp / "ckpt")]


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


def test_pp2_equals_one_rank(dp2):
    ref = run_steps(tiny_config("llama", 1, **MOE), STEPS)
    got = {"losses": next(r["pp2"]["losses"] for r in dp2[:2] if r["pp2"]["losses"] is not None),
           "params": {n: p for r in dp2[:2] for n, p in r["pp2"]["params"].items()}}
    assert_close_runs(ref, got)


def test_saved_at_dp2_resumes_on_one_rank(dp2):
    """Expert weights, their Adam states and the expert bias saved at DP 2 (distributed optimizer)
    load on one rank: the next step equals an uninterrupted one-rank run."""
    from tests.parallel.test_data_parallel import train
    straight = train(tiny_config("llama", 1, **MOE), STEPS)
    resumed = train(tiny_config("llama", 1, **MOE, load=dp2[2]), 1)
    assert_close_runs({"losses": straight["losses"][-1:], "params": straight["params"]}, resumed)
