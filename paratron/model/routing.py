"""The router's choice of experts as pure functions of its logits [tokens, experts] (Megatron-core's
moe_utils routing): top-k over softmax or sigmoid scores, optionally limited to the best expert
groups (DeepSeek-V3's node-limited routing), Sinkhorn routing (S-BASE), and the random logits of
--moe-router-force-load-balancing.

Each returns (probs [tokens, experts], zero off the chosen experts; routing_map [tokens, experts]
bool, the chosen experts).
"""
from __future__ import annotations

from typing import Optional

import torch


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Megatron's group-limited top-k: the experts are ``num_groups`` contiguous groups; each token
    keeps the ``group_topk`` groups whose best ``topk // group_topk`` scores sum highest, and takes its
    top-k experts among those groups only. Returns (the chosen scores, their expert indices)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(group_topk, dim=-1, sorted=False).indices, True)
    allowed = keep.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def _topk(scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, topk, dim=-1)


def _as_map(logits: torch.Tensor, index: torch.Tensor, top: torch.Tensor):
    probs = torch.zeros_like(logits).scatter(1, index, top.to(logits.dtype))
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)


def topk_route(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
               scaling_factor: Optional[float] = None, expert_bias: Optional[torch.Tensor] = None,
               num_groups: Optional[int] = None, group_topk: Optional[int] = None):
    """Megatron's top-k routing. softmax: top-k of the logits then a softmax over them, or
    (``pre_softmax``) a softmax over all experts then its top-k. sigmoid: top-k of the sigmoid scores,
    normalised over the chosen k (DeepSeek-V3). ``expert_bias`` (sigmoid) is added to the scores for
    choosing only; the probabilities are the unbiased scores. ``group_topk``: the choice is limited to
    that many of ``num_groups`` expert groups (:func:`group_limited_topk`, applied to what top-k reads:
    the logits, the softmax or the biased sigmoid scores)."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            top, index = _topk(scores, topk, num_groups, group_topk)
        else:
            top, index = _topk(logits, topk, num_groups, group_topk)
            top = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        choose = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        index = _topk(choose, topk, num_groups, group_topk)[1]
        top = torch.gather(scores, 1, index)
        if topk > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        top = top * scaling_factor
    return _as_map(logits, index, top)


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str = "softmax"):
    """The scores over all experts the load-balancing losses use (softmax; sigmoid normalised per
    token) and the top-k map of those scores (the expert bias and the groups play no part)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    index = torch.topk(scores, topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, index, True)


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(``cost``) [tokens, experts]: alternately rescale rows and
    columns (row sums towards 1/tokens, column sums towards 1/experts) until the mean change of the
    column factors is at most ``tol``; returns the rescaled matrix (Megatron's moe_utils.sinkhorn)."""
    k = torch.exp(cost)
    rows, cols = k.shape
    d0 = torch.ones(rows, device=k.device, dtype=k.dtype)
    d1 = torch.ones(cols, device=k.device, dtype=k.dtype)
    eps = 1e-8
    change = float("inf")
    while change > tol:  # a host read per sweep, as Megatron's loop
        d0 = 1.0 / rows / ((d1 * k).sum(dim=1) + eps)
        new = 1.0 / cols / ((d0[:, None] * k).sum(dim=0) + eps)
        change = (d1 - new).abs().mean().item()
        d1 = new
    return d1 * k * d0[:, None]


def sinkhorn_route(logits: torch.Tensor, topk: int, training: bool):
    """Megatron's Sinkhorn routing: in training the experts are the top-k of the Sinkhorn-balanced
    fp32 logits (no gradient), otherwise the top-k of the activation; the probabilities are the
    activation (sigmoid for top-1, else the softmax over all experts) at the chosen experts."""
    if topk == 1:
        act = torch.sigmoid(logits)
    else:
        act = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            index = torch.topk(sinkhorn(logits.float()), topk, dim=1).indices
    else:
        index = torch.topk(act, topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return act * routing_map, routing_map


class RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing: the forward replaces the logits by standard normal draws
    (from the current generator: the caller forks the expert-parallel stream); the backward passes
    the gradient through unchanged (a straight-through estimator, Megatron's RandomSTE)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad
