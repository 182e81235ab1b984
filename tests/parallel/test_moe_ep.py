"""Expert parallelism on 4 gloo ranks equals one rank within 1e-5 (dropless, fp32): EP 2 and EP 4,
MoE under context parallelism (CP 4; CP 2 x EP 2; CP 2 x TP 2 x EP 2 with sequence parallelism),
TP 2 x EP 2 with sequence parallelism (experts also split over expert-TP 2) and without it (also with MoE
latent projections, and CP 2 x EP 2 with them), TP 2 x EP 2
with expert-TP 1 (the EP group is the TP group) over the allgather dispatcher, TP 2 with EP 1 and
expert-TP 1 (experts replicated over TP, tokens split), PP 2 x EP 2, and EP 2 inside DP 4 with the
distributed optimizer. Gradient clipping is active in every step (a gradient
reduced over the wrong group, or counted twice in the norm, changes the update). Reducing the
expert gradients over the data-parallel group instead of the expert-data-parallel one is shown to
break the equality. A checkpoint saved at EP 2 resumes at EP 1, EP 4 and TP 2 x EP 2. The two
dispatchers (alltoall also with --moe-permute-fusion's fused gather / copy of the received rows, and under
--deterministic-mode with one matmul per expert and source rank) give the one-rank layer's outputs and gradients."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config
from tests.parallel.test_moe_dp import _pipeline

STEPS, SAVE_AFTER = 3, 1
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
           moe_grouped_gemm=True, moe_router_dtype="fp32", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=1e-2, clip_grad=0.05)
EP2 = dict(expert_model_parallel_size=2)
TP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)
LAYOUTS = {  # name: flags on 4 ranks
    "ep2": EP2,
    "ep4": dict(expert_model_parallel_size=4),
    "tp2_ep2_sp": dict(TP2, sequence_parallel=True),
    "tp2_ep2": TP2,
    "tp2_ep2_etp1_allgather": dict(TP2, sequence_parallel=True, expert_tensor_parallel_size=1,
                                   moe_token_dispatcher_type="allgather"),
    "dp4_ep2_distopt": dict(EP2, use_distributed_optimizer=True, overlap_grad_reduce=True),
    # every expert on every rank, each TP rank routing its sequence shard (no token moves)
    "tp2_sp_ep1_etp1": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
    # context parallelism: each CP rank routes its chunks of every sequence (balance losses, expert-bias
    # counts summed over CP); experts replicated over CP 4, or split over EP 2 inside CP 2 x DP 2
    "cp4": dict(context_parallel_size=4),
    "cp2_ep2": dict(context_parallel_size=2, **EP2),
    "cp2_tp2_sp_ep2": dict(context_parallel_size=2, sequence_parallel=True, **TP2),
}
LATENT = dict(MOE, moe_latent_size=16)  # the experts in a 16-wide latent space between two replicated projections
LATENT_LAYOUTS = {"tp2_ep2_sp": dict(TP2, sequence_parallel=True), "tp2_ep2": TP2,
                  "cp2_ep2": dict(context_parallel_size=2, **EP2)}
RESUMED = {  # name: flags of the resumed run (the saving run uses the distributed optimizer)
    "ep4": dict(expert_model_parallel_size=4),
    "tp2_ep2_sp_distopt": dict(TP2, sequence_parallel=True, use_distributed_optimizer=True),
}


def _wrong_group(cfg) -> dict:
    """The EP 2 run with the expert gradients put in the dense (data x context parallel) buffers."""
    from paratron.parallel import data

    real = data.buffer_keys

    def dense_only(params, fp8=frozenset()):
        merged: dict = {}
        for (group, tied, in_fp8), ps in real(params, fp8).items():
            merged.setdefault(("dp_cp" if group == "edp" else group, tied, in_fp8), []).extend(ps)
        return merged

    data.buffer_keys = dense_only
    try:
        return run_steps(cfg, STEPS)
    finally:
        data.buffer_keys = real


def _dispatch(rank: int, world: int) -> dict:
    """Both dispatchers at EP 4 and at expert-TP 2 x EP 2 against all experts on one rank: outputs and
    the gradients of the tokens, the probabilities and (gathered) the expert weights."""
    from paratron.config import ModelConfig
    from paratron.model import moe
    from paratron.parallel.experts import DISPATCHERS, ExpertLayout
    from paratron.parallel.dims import initialize_model_parallel
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, num_experts=8,
                      moe_router_topk=2, moe_ffn_hidden_size=8, swiglu=True).resolved()
    g = torch.Generator().manual_seed(3)
    tokens_all = torch.randn(world, 12, 16, generator=g)
    logits_all = torch.randn(world, 12, 8, generator=g)
    logits_all[:, :, 7] -= 100  # expert 7 gets no token: an empty group on its rank
    out = {}
    for name, sizes in {"ep4": dict(expert_model_parallel_size=4),
                        "etp2_ep2": dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2)}.items():
        dims = initialize_model_parallel(**sizes)
        lay = ExpertLayout.from_dims(dims, 8)
        torch.manual_seed(5)
        experts = moe.Experts(cfg, lay=lay)
        variants = [(kind, fn, False) for kind, fn in DISPATCHERS.items()] + [
            ("alltoall_fused", DISPATCHERS["alltoall"], True),  # --moe-permute-fusion on the received rows
            ("alltoall_deterministic", DISPATCHERS["alltoall"], False)]  # one matmul per expert and source rank
        for kind, fn, fused in variants:
            experts.grouped = experts.permute_fusion = fused
            x = tokens_all[rank].clone().requires_grad_()
            probs, rmap = moe.topk_route(logits_all[rank].clone().requires_grad_(), 2)
            probs.retain_grad()
            torch.use_deterministic_algorithms(kind == "alltoall_deterministic")
            with MatmulCount() as mm:
                y = fn(x, probs, rmap, experts, lay)
            torch.use_deterministic_algorithms(False)
            (y * torch.arange(16.0)).sum().backward()
            out[(name, kind)] = {"y": y.detach(), "gx": x.grad, "gp": probs.grad, "matmuls": mm.count,
                                 "gw": {n: _grad_global(p, dims) for n, p in experts.named_parameters()}}
            experts.zero_grad()
    return out


class MatmulCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products run inside it."""
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _grad_global(p, dims):
    """The gradient of ``p`` as a global tensor (gathered as the parameter would be)."""
    from paratron.parallel.sharding import set_spec, spec_of
    from paratron.parallel.tensor import gather_global
    g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
    for name in spec_of(p).sum_over:  # the fc2 bias, added on expert-TP rank 0 only
        torch.distributed.all_reduce(g, group=dims.group(name))
    return gather_global(set_spec(g, spec_of(p)), dims)


def _run(rank: int, world: int, root: str) -> dict:
    out = {name: run_steps(tiny_config("llama", world, **MOE, **flags), STEPS) for name, flags in LAYOUTS.items()}
    out.update({("latent", name): run_steps(tiny_config("llama", world, **LATENT, **flags), STEPS)
                for name, flags in LATENT_LAYOUTS.items()})
    out["pp2_ep2"] = _pipeline(tiny_config("llama", world, **MOE, pipeline_model_parallel_size=2, **EP2))
    out["wrong_group"] = _wrong_group(tiny_config("llama", world, **MOE, **EP2))
    out["dispatch"] = _dispatch(rank, world)
    from tests.parallel.test_data_parallel import train
    train(tiny_config("llama", world, **MOE, **EP2, use_distributed_optimizer=True, save=root), STEPS,
          save_after=SAVE_AFTER)
    for name, flags in RESUMED.items():
        cfg = tiny_config("llama", world, **MOE, **flags, load=root)
        out[("resumed", name)] = train(cfg, STEPS - SAVE_AFTER)["losses"]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ep")
    return run_ranks(4, _run, str(tmp / "ckpt"), tmp_dir=tmp) + [str(tmp / "ckpt")]


@pytest.fixture(scope="module")
def reference():
    from tests.parallel.test_data_parallel import train
    return train(tiny_config("llama", 1, **MOE), STEPS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_equals_one_rank(ranks, reference, layout):
    for rank in range(4):
        assert_close_runs(reference, ranks[rank][layout])
    assert reference["losses"][-1] != reference["losses"][0]


@pytest.mark.parametrize("layout", list(LATENT_LAYOUTS))
def test_latent_moe_equals_one_rank(ranks, layout):
    """--moe-latent-size: the replicated projections' gradients summed over the TP ranks' token shares."""
    from tests.parallel.test_data_parallel import train
    reference = train(tiny_config("llama", 1, **LATENT), STEPS)
    assert any("fc1_latent_proj" in n for n in reference["params"])
    for rank in range(4):
        assert_close_runs(reference, ranks[rank][("latent", layout)])


def test_clipping_is_active(reference):
    """The reference's gradient norm is above --clip-grad in every step, so the norm matters."""
    assert min(reference["norms"]) > 2 * MOE["clip_grad"], reference["norms"]


def test_pp2_ep2_equals_one_rank(ranks, reference):
    runs = [r["pp2_ep2"] for r in ranks[:4]]
    got = {"losses": next(r["losses"] for r in runs if r["losses"] is not None),
           "params": {n: p for r in runs for n, p in r["params"].items()}}
    assert_close_runs(reference, got)


def test_expert_grads_over_the_wrong_group_differ(ranks, reference):
    """The same comparison fails when the expert gradients are all-reduced over DP (mixing different
    experts' gradients) instead of expert-DP."""
    got = ranks[0]["wrong_group"]["params"]
    errors = {n: ((a - got[n]).norm() / a.norm()).item() for n, a in reference["params"].items() if ".experts." in n}
    assert min(errors.values()) > 1e-3, errors


@pytest.mark.parametrize("layout", ["ep4", "etp2_ep2"])
def test_dispatchers_equal_one_rank_layer(ranks, layout):
    from paratron.config import ModelConfig
    from paratron.model import moe
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, num_experts=8,
                      moe_router_topk=2, moe_ffn_hidden_size=8, swiglu=True).resolved()
    g = torch.Generator().manual_seed(3)
    tokens_all = torch.randn(4, 12, 16, generator=g)
    logits_all = torch.randn(4, 12, 8, generator=g)
    logits_all[:, :, 7] -= 100
    torch.manual_seed(5)
    experts = moe.Experts(cfg)
    x = tokens_all.reshape(48, 16).clone().requires_grad_()
    probs, rmap = moe.topk_route(logits_all.reshape(48, 8), 2)
    probs = probs.detach().requires_grad_()
    expert_index, token_index = rmap.t().nonzero(as_tuple=True)
    y = experts(x[token_index], rmap.sum(0), expert_index) * probs[token_index, expert_index][:, None]
    y = torch.zeros(48, 16).index_add(0, token_index, y)
    (y * torch.arange(16.0)).sum().backward()
    for kind in ("alltoall", "allgather", "alltoall_fused", "alltoall_deterministic"):
        for rank in range(4):
            got = ranks[rank]["dispatch"][(layout, kind)]
            rows = slice(12 * rank, 12 * (rank + 1))
            torch.testing.assert_close(got["y"], y[rows].detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["gx"], x.grad[rows], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["gp"], probs.grad[rows], rtol=1e-5, atol=1e-6)
        # each rank's expert gradients hold the contributions of every rank's tokens
        for n, p in experts.named_parameters():
            torch.testing.assert_close(ranks[0]["dispatch"][(layout, kind)]["gw"][n], p.grad, rtol=1e-5, atol=1e-6)
    # under --deterministic-mode each local expert multiplies each source rank's rows on their own (fc1 and fc2):
    # 2 local experts x 4 sources at EP 4, 4 x 4 at expert-TP 2 x EP 2; else one matmul per local expert
    sources, local = {"ep4": (4, 2), "etp2_ep2": (4, 4)}[layout]
    assert ranks[0]["dispatch"][(layout, "alltoall_deterministic")]["matmuls"] == 2 * local * sources
    assert ranks[0]["dispatch"][(layout, "alltoall")]["matmuls"] == 2 * local


@pytest.mark.parametrize("layout", list(RESUMED))
def test_saved_at_ep2_resumes_elsewhere(ranks, reference, layout):
    """Saved at EP 2 (distributed optimizer) after one step; the next steps at EP 4 (plain optimizer)
    and TP 2 x EP 2 (distributed optimizer) give the uninterrupted run's losses."""
    got = ranks[3][("resumed", layout)]
    assert len(got) == STEPS - SAVE_AFTER
    for a, b in zip(reference["losses"][SAVE_AFTER:], got):
        assert abs(a - b) <= 1e-5 * abs(a), (layout, got, reference["losses"])


def test_saved_at_ep2_resumes_on_one_rank(ranks, reference):
    from tests.parallel.test_data_parallel import train
    resumed = train(tiny_config("llama", 1, **MOE, load=ranks[4]), STEPS - SAVE_AFTER)
    assert_close_runs({"losses": reference["losses"][SAVE_AFTER:], "params": reference["params"]}, resumed)
