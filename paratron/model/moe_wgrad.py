"""--delay-wgrad-compute: the routed experts' weight gradients computed after the dispatch's backward all-to-all has
started (Megatron's delayed weight-gradient computation, which it accepts only with --overlap-moe-expert-parallel-comm).

In the backward of an MoE layer the experts' grouped GEMMs come between the combine's and the dispatch's
all-to-alls. Computing only their input gradients there lets the dispatch's all-to-all start sooner; the weight
gradients, owed until then, are computed while its rows travel (``MoELayer._take_turn`` settles them right after
starting it, before handing the turn to the other micro-batch: parallel/turns.py). Each weight gradient reaches the
parameter through autograd (its ``AccumulateGrad`` and hooks, so data parallelism's gradient buffers see it as any
other), with the same GEMM autograd would have run: the gradients equal the undelayed ones bit for bit.
"""
from __future__ import annotations

import torch


class OwedWeightGrads:
    """The weight gradients one layer's experts owe: ``mm`` runs a grouped GEMM whose backward computes the input
    gradient and leaves the weight's; ``settle`` computes and delivers them."""

    def __init__(self):
        self.owed: list = []

    def mm(self, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``torch._grouped_mm(a, w.transpose(1, 2), offs=ends)`` with the weight gradient owed (``w`` enters the
        graph detached: no gradient edge to it, so nothing reaches its accumulator before ``settle``)."""
        return _GroupedMM.apply(a, w.detach(), ends, (w,), self)  # (in a tuple: not an input of the graph)

    def settle(self) -> None:
        owed, self.owed = self.owed, []
        for w, a, g, ends in owed:
            grad = torch._grouped_mm(a.t(), g, offs=ends).transpose(1, 2)  # (autograd's formula for mat_b)
            with torch.enable_grad():
                torch.autograd.backward(w.view_as(w), grad)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, ends, param: tuple, owed: OwedWeightGrads):
        """``w``: the weight's values (detached); ``param``: (the weight whose gradient is owed,)."""
        ctx.save_for_backward(a, w, ends)
        (ctx.param,), ctx.owed = param, owed
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, g):
        a, w, ends = ctx.saved_tensors
        da = torch._grouped_mm(g, w, offs=ends) if ctx.needs_input_grad[0] else None  # (autograd's, for mat_a)
        if ctx.param.requires_grad:
            ctx.owed.owed.append((ctx.param, a, g, ends))
        return da, None, None, None, None
