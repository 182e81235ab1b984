"""Megatron's variants on sharded weights equal the one-rank run: zero-centred norms (--apply-layernorm-1p,
q/k layernorm included) under TP2 with sequence parallelism; quick-GeGLU with offset and clamp and the
attention output gate under TP2; the Muon optimizer under TP2 (the matrices gathered whole for
Newton-Schulz) and over two data-parallel ranks with the distributed optimizer (momentum shards
gathered), with --decoupled-lr on the embedding and output layer."""
import pytest
import torch

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 2
CASES = {
    "layernorm_1p_sp": ("llama", dict(apply_layernorm_1p=True, qk_layernorm=True), dict(sequence_parallel=True)),
    "quick_geglu_gate": ("gpt", dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.05,
                                     attention_output_gate=True), {}),
    "muon_decoupled": ("llama", dict(optimizer="muon", muon_fp32_matmul_prec="highest", decoupled_lr=3e-2,
                                     decoupled_min_lr=1e-3, lr_decay_style="cosine"), {}),
}


def _config(case: str, world: int, layout: str):
    style, options, extra = CASES[case]
    parallel = {"tp": dict(tensor_model_parallel_size=world, **extra), "dp": dict(use_distributed_optimizer=True),
                "one": {}}[layout]
    return tiny_config(style, world_size=world, **options, **parallel)


def _rank(rank, world, case, layout):
    return run_steps(_config(case, world, layout), STEPS)


@pytest.mark.parametrize("case,layout", [("layernorm_1p_sp", "tp"), ("quick_geglu_gate", "tp"),
                                         ("muon_decoupled", "tp"), ("muon_decoupled", "dp")])
def test_variant_equals_single_rank(tmp_path, case, layout):
    ref = run_steps(_config(case, 1, "one"), STEPS)
    for r in run_ranks(2, _rank, case, layout, tmp_dir=tmp_path):
        assert_close_runs(ref, r, rtol=2e-5)


class _Lopsided(torch.nn.Module):
    """A matrix and a large vector: laid out in reverse, data-parallel rank 0's shard of the one bucket
    holds only the vector, so that rank has no piece of any Muon matrix."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=g))
        self.v = torch.nn.Parameter(torch.randn(1000, generator=g))

    def forward(self, x):
        return (self.w @ x).square().sum() + (self.v * x.sum()).sum()


def _lopsided(rank, world, distributed):
    from paratron.optim.distributed import DistributedOptimizer
    from paratron.optim.optimizer import build_optimizer
    from paratron.parallel.data import DataParallel, finalize_model_grads
    from paratron.parallel.dims import initialize_model_parallel
    dims = initialize_model_parallel()
    cfg = tiny_config(world_size=world, optimizer="muon", muon_fp32_matmul_prec="highest",
                      use_distributed_optimizer=distributed)
    model = DataParallel(_Lopsided(), dims, use_distributed_optimizer=distributed)
    opt = build_optimizer([model], cfg, dims)
    assert isinstance(opt, DistributedOptimizer) == distributed
    for step in range(2):
        model.zero_grad_buffer()
        model(torch.arange(4.0) + step + rank).backward()
        finalize_model_grads([model], dims)
        opt.step()
    return {"muon_items": len(opt.muon.items), "w": model.module.w.detach().clone()}


def test_muon_distributed_optimizer_with_a_rank_holding_no_matrix(tmp_path):
    plain = run_ranks(2, _lopsided, False, tmp_dir=tmp_path)
    sharded = run_ranks(2, _lopsided, True, tmp_dir=tmp_path)
    assert sorted(r["muon_items"] for r in sharded) == [0, 1]
    for r in sharded:
        torch.testing.assert_close(r["w"], plain[0]["w"], rtol=1e-5, atol=1e-7)
