"""The routing flags of issue 19 on 4 gloo ranks equal one rank within 1e-5 (fp32, clipped steps):
DeepSeek-V3-style group-limited routing (sigmoid scores, expert bias, 8 experts in 4 groups, top-4
within 2 groups, scaled) with a gated shared expert at EP 2, TP 2 x EP 2 with sequence parallelism,
and TP 2 x EP 2 without it over the flex dispatcher (hybridep backend: paratron's alltoall), EP 2 and TP 2 x
EP 2 with the shared expert overlapped with the dispatch all-to-all, EP 2 with token dropping padded to
capacity (the split sizes known without a count exchange); Sinkhorn
top-1 routing at EP 2 (each rank's micro-batch is one of the reference's, so Sinkhorn balances the
same tokens). Under TP 2 x EP 2 each TP rank balances its own sequence shard (as Megatron's routers
under sequence parallelism): the Sinkhorn MoE layer's outputs and input gradients there equal the
one-rank layer's applied to each shard."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config
from tests.parallel.test_data_parallel import train

STEPS = 3
GROUPED = dict(num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2, moe_router_num_groups=4,
               moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
               moe_router_load_balancing_type="seq_aux_loss",
               moe_aux_loss_coeff=1e-2, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
               moe_grouped_gemm=True, moe_router_dtype="fp32", clip_grad=0.05)
SINKHORN = dict(num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=32, moe_router_load_balancing_type="sinkhorn",
                moe_z_loss_coeff=1e-3, moe_router_dtype="fp32", clip_grad=0.05)
CAPACITY = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_expert_capacity_factor=1.0,
                moe_pad_expert_input_to_capacity=True, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
                moe_router_dtype="fp32", clip_grad=0.05)
TP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)
RUNS = {  # name: (MoE flags, layout flags on 4 ranks)
    "grouped_ep2": (GROUPED, dict(expert_model_parallel_size=2)),
    "grouped_tp2_ep2_sp": (GROUPED, dict(TP2, sequence_parallel=True)),
    "grouped_tp2_ep2_flex": (GROUPED, dict(TP2, moe_token_dispatcher_type="flex",
                                           moe_flex_dispatcher_backend="hybridep")),
    "sinkhorn_ep2": (SINKHORN, dict(expert_model_parallel_size=2)),
    # --moe-shared-expert-overlap: the gated shared expert computed while the dispatch all-to-all is in flight
    "grouped_ep2_overlap": (GROUPED, dict(expert_model_parallel_size=2, moe_shared_expert_overlap=True)),
    "grouped_tp2_ep2_overlap": (GROUPED, dict(TP2, moe_shared_expert_overlap=True)),
    # padded to capacity: the all-to-all's split sizes known without exchanging or reading the counts
    "capacity_ep2": (CAPACITY, dict(expert_model_parallel_size=2)),
}
LAYER = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, num_experts=8, moe_router_topk=1,
             moe_ffn_hidden_size=8, swiglu=True, moe_router_load_balancing_type="sinkhorn")


def _layer_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 16, 3, 16, generator=g)  # [data-parallel rank, sequence, batch, hidden]


def _sinkhorn_layer(rank: int, world: int) -> dict:
    """The Sinkhorn MoE layer at TP 2 (sequence parallel) x EP 2: this rank's shard's outputs and
    input gradients."""
    from paratron.config import ModelConfig
    from paratron.model import moe
    from paratron.model.layers import Parallel
    from paratron.parallel.dims import initialize_model_parallel
    dims = initialize_model_parallel(**TP2)
    cfg = ModelConfig(**LAYER).resolved()
    torch.manual_seed(5)
    layer = moe.MoELayer(cfg, Parallel(tp_group=dims.tp_group, tp_size=2, sequence_parallel=True, dims=dims))
    x = _layer_inputs()[dims.dp_rank, 8 * dims.tp_rank:8 * (dims.tp_rank + 1)].clone().requires_grad_()
    y = layer(x)
    (y * torch.arange(16.0)).sum().backward()
    return {"dp": dims.dp_rank, "tp": dims.tp_rank, "y": y.detach(), "gx": x.grad}


def _run(rank: int, world: int) -> dict:
    out = {name: run_steps(tiny_config("llama", world, **moe_flags, **flags), STEPS)
           for name, (moe_flags, flags) in RUNS.items()}
    out["layer"] = _sinkhorn_layer(rank, world)
    return out


@pytest.fixture(scope="module")
def references():
    return {"grouped": train(tiny_config("llama", 1, **GROUPED), STEPS),
            "sinkhorn": train(tiny_config("llama", 1, **SINKHORN), STEPS),
            "capacity": train(tiny_config("llama", 1, **CAPACITY), STEPS)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(4, _run, tmp_dir=tmp_path_factory.mktemp("moe_routing"))


@pytest.mark.parametrize("name", list(RUNS))
def test_routing_equals_one_rank(ranks, references, name):
    reference = references[name.split("_")[0]]
    for rank in range(4):
        assert_close_runs(reference, ranks[rank][name])
    assert reference["losses"][-1] != reference["losses"][0]
    if name.startswith("grouped"):  # the gate and the expert bias are trained / updated
        assert any(n.endswith("shared_experts.gate_weight") for n in reference["params"])


def test_sinkhorn_layer_under_tp2_ep2_balances_each_shard(ranks):
    from paratron.config import ModelConfig
    from paratron.model import moe
    from paratron.model.layers import Parallel
    cfg = ModelConfig(**LAYER).resolved()
    torch.manual_seed(5)
    layer = moe.MoELayer(cfg, Parallel())
    inputs = _layer_inputs()
    for r in ranks:
        got = r["layer"]
        x = inputs[got["dp"], 8 * got["tp"]:8 * (got["tp"] + 1)].clone().requires_grad_()
        y = layer(x)
        (y * torch.arange(16.0)).sum().backward()
        torch.testing.assert_close(got["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["gx"], x.grad, rtol=1e-5, atol=1e-6)
    # balancing the whole sequence at once routes some tokens elsewhere: the shards matter
    _, whole = layer.router(inputs[0].reshape(-1, 16), 16)
    _, halves = zip(*(layer.router(inputs[0, 8 * t:8 * (t + 1)].reshape(-1, 16), 8) for t in range(2)))
    assert not torch.equal(whole, torch.cat(halves))
