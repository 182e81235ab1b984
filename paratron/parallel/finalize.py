"""What Megatron's ``finalize_model_grads`` does after the last backward of a step: each data-parallel
gradient buffer's reduction (paratron/parallel/data.py), then the sums over model-parallel groups."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dims import ParallelDims


def finalize_model_grads(models: list, dims: ParallelDims, num_tokens=None) -> None:
    """After the last backward of a step: each gradient buffer's reduction over its group, then the
    sums of partial gradients over model-parallel groups (``spec.sum_over``: sequence-parallel
    replicated parameters over TP), then the sum of tied copies over their group (the word
    embedding's two pipeline copies over the embedding group). After a reduce-scatter only this
    rank's shard of each gradient is right; the later sums keep it right because the ranks of those
    groups share one buffer layout, and a tied parameter has a buffer of its own.

    ``num_tokens`` (``--calculate-per-token-loss``): this rank's loss-token count of the step (known
    on the last pipeline stage); the gradients, summed rather than averaged over data parallelism,
    are divided by the global count."""
    for m in models:
        m.finish_grad_sync()
    partial: dict = {}
    for m in models:
        for name, grads in m.partial_grads.items():
            partial.setdefault(name, []).extend(grads)
    for name in sorted(partial):
        # (a ZeRO-3 shard may hold none of them: then neither do the group's other ranks, which share its layout)
        if dims.size(name) > 1 and partial[name]:
            _all_reduce_flat(partial[name], dims.group(name))
    tied = [p for m in models for p in m.tied_params]
    if dims.pp > 1 and dims.embedding_group is not None and not models[0].tied_checked:
        _check_tied_embedding(len(tied), dims, models[0].grad_buffer.device)
        models[0].tied_checked = True
    for name, g in (t for m in models for t in m.tied_grads):
        if dims.size(name) > 1:
            dist.all_reduce(g, group=dims.group(name))
    if num_tokens is not None:
        total = global_token_count(num_tokens, dims, models[0].grad_buffer.device)
        for m in models:
            m.scale_grads(1.0 / total.clamp(min=1))


def global_token_count(num_tokens, dims: ParallelDims, device) -> torch.Tensor:
    """The step's loss-token count over the pipeline (from its last stage) and data x context
    parallelism, as a 0-d fp64 tensor on ``device`` (exact far beyond fp32's 2^24)."""
    n = torch.as_tensor(num_tokens, device=device).detach().to(torch.float64).reshape(()).clone()
    if dims.pp > 1:
        dist.broadcast(n, src=dims.pp_peer(dims.pp - 1 - dims.pp_rank), group=dims.pp_group)
    if dims.dp_cp > 1:
        dist.all_reduce(n, group=dims.dp_cp_group)
    return n


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _check_tied_embedding(count: int, dims: ParallelDims, device) -> None:
    """Once per run: the first and last pipeline stage must hold the same number of tied copies
    (``ShardSpec.tied``), or the all-reduce above would hang."""
    lo = torch.tensor([count], device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=dims.embedding_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=dims.embedding_group)
    if lo.item() != hi.item():
        raise RuntimeError(
            f"the first and last pipeline stages hold {lo.item()} and {hi.item()} tied parameters: the first "
            "stage's word embedding and the last stage's output-layer copy both need ShardSpec.tied = "
            "'embedding' (their gradients are summed over the embedding group)")
