"""Tensor and sequence parallelism on CPU/gloo equal the one-rank run (loss and parameters)."""
import pytest
import torch
import torch.nn.functional as F

from paratron.parallel.dims import initialize_model_parallel
from paratron.parallel.tensor import vocab_parallel_cross_entropy
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 3


def _tp_rank(rank, world, style, sp):
    cfg = tiny_config(style, tensor_model_parallel_size=world, sequence_parallel=sp)
    return run_steps(cfg, STEPS)


@pytest.mark.parametrize("style", ["gpt", "llama"])
@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tp_equals_single_rank(tmp_path, style, tp, sp):
    ref = run_steps(tiny_config(style), STEPS)
    results = run_ranks(tp, _tp_rank, style, sp, tmp_dir=tmp_path)
    for r in results:
        assert_close_runs(ref, r)


def _ce_rank(rank, world):
    dims = initialize_model_parallel(world)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 40, generator=g, dtype=torch.float64)
    target = torch.randint(0, 40, (6, 3), generator=g)
    mine = logits.chunk(world, -1)[dims.tp_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target, dims.tp_group)
    loss.sum().backward()
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.view(-1, 40), target.view(-1), reduction="none").view(6, 3)
    ref.sum().backward()
    return {"loss_err": (loss.double() - ref).abs().max().item(),
            "grad_err": (mine.grad - full.grad.chunk(world, -1)[dims.tp_rank]).abs().max().item()}


def test_vocab_parallel_cross_entropy_equals_torch(tmp_path):
    for r in run_ranks(2, _ce_rank, tmp_dir=tmp_path):
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-6
