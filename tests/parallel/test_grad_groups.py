"""Gradient buffers per reduction group: a parameter declared with its own reduce group (a stand-in
for an expert weight: split over EP, reduced over expert-data-parallel ranks) has its gradient
reduced over that group only, and enters the gradient norm once, with the plain and the
distributed optimizer alike."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist import run_ranks

WORLD, EP = 4, 2  # DP 4; EP 2 -> expert-data-parallel groups {0, 2} and {1, 3}


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(3, generator=g), torch.randn(1, 3, generator=g)


class StandIn(nn.Module):
    """A dense weight and an 'expert' weight: global [EP, 3], row e on EP rank e."""

    def __init__(self, dims):
        super().__init__()
        from paratron.parallel.sharding import ShardSpec, Split, set_spec, shard
        self.dense = nn.Parameter(torch.ones(3))
        full = torch.arange(EP * 3, dtype=torch.float32).view(EP, 3)
        spec = ShardSpec(splits=(Split(0, "ep", (EP,)),), grad_group="edp")
        self.expert = set_spec(nn.Parameter(shard(full, spec, {"ep": (dims.ep_rank, EP)})), spec)

    def forward(self, x, y):
        return (self.dense * x).sum() + (self.expert * y).sum()


def _run(rank, world):
    return {name: _step(rank, distributed) for name, distributed in (("plain", False), ("distopt", True))}


def _step(rank, distributed):
    from paratron.optim.distributed import DistributedOptimizer
    from paratron.optim.optimizer import Optimizer
    from paratron.parallel.data import DataParallel, finalize_model_grads
    from paratron.parallel.dims import initialize_model_parallel
    from tests.parallel.common import tiny_config
    dims = initialize_model_parallel(expert_model_parallel_size=EP)
    model = DataParallel(StandIn(dims), dims, use_distributed_optimizer=distributed, bucket_size=None)
    cfg = tiny_config()
    opt = DistributedOptimizer([model], cfg, dims) if distributed else Optimizer(model.params, cfg, dims)
    model.zero_grad_buffer()
    model(*_inputs(rank)).backward()
    finalize_model_grads([model], dims)
    norm = opt._norm_sq(opt._grads()).sqrt().item()
    params_norm = opt.params_norm()
    return {"ep_rank": dims.ep_rank, "edp_peers": dims.group_ranks["edp"], "groups": len(model.grad_buffers),
            "dense": model.module.dense.main_grad.clone(), "expert": model.module.expert.main_grad.clone(),
            "norm": norm, "params_norm": params_norm, "dense_owner": dims.coordinate("dp_cp") == 0, "expert_owner": dims.coordinate("edp") == 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(WORLD, _run, tmp_dir=tmp_path_factory.mktemp("groups"))


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_a_parameter_with_its_own_reduce_group(runs, distributed):
    out = [r["distopt" if distributed else "plain"] for r in runs]
    xs = [_inputs(r)[0] for r in range(WORLD)]
    ys = [_inputs(r)[1] for r in range(WORLD)]
    dense = sum(xs) / WORLD  # averaged over every data-parallel rank
    expert_rows = {}
    for r, o in enumerate(out):
        assert o["groups"] == 2 and o["edp_peers"] == [r % EP, r % EP + EP]
        # Megatron's scaling: divided by the DP size, summed over the expert-data-parallel peers only
        want = sum(ys[p] for p in o["edp_peers"]) / WORLD
        # after a reduce-scatter only the rank owning the shard (the tiny tensors fit in the first
        # shard of their buffer) holds the reduced gradient
        if not distributed or o["dense_owner"]:
            assert torch.allclose(o["dense"], dense, atol=1e-6), (r, o["dense"], dense)
        if not distributed or o["expert_owner"]:
            assert torch.allclose(o["expert"], want, atol=1e-6), (r, o["expert"], want)
        expert_rows[o["ep_rank"]] = want
    # the norm counts the dense gradient once and each expert row once (not once per replica)
    expect = (dense.square().sum() + sum(v.square().sum() for v in expert_rows.values())).sqrt().item()
    # --log-params-norm counts alike: the dense weight once, each expert row once
    weights = (torch.ones(3).square().sum() + torch.arange(EP * 3.0).square().sum()).sqrt().item()
    for o in out:
        assert abs(o["norm"] - expect) <= 1e-5 * expect, (o["norm"], expect)
        assert abs(o["params_norm"] - weights) <= 1e-5 * weights, (o["params_norm"], weights)
