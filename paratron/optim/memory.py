"""What a rank holds between steps, counted from its tensors, and the shares the sharding strategy predicts.

``per_rank_state_bytes(models, optimizer)`` counts the bytes of storage this rank holds for the model's
parameters, gradients and optimizer state (device and host) after a step: a freed ZeRO-2/3 buffer counts
zero, a shard its own size. ``predicted_state_bytes`` is the textbook share of the same for a model of
``n`` parameters (before padding): each strategy divides what it shards by the data-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass


def _nbytes(t) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def per_rank_state_bytes(models: list, optimizer) -> dict:
    """{"params", "grads", "optimizer", "optimizer_host"}: bytes this rank holds for its model chunks
    (``DataParallel``-wrapped) and their optimizer, counted from the tensors' storage. ``params`` and
    ``grads`` are the data-parallel buffers (whole, or this rank's shard plus any bucket still gathered);
    ``optimizer`` is the optimizer's state_bytes() (Adam moments, fp32 masters that are copies), of which
    ``optimizer_host`` is in host memory (--optimizer-cpu-offload)."""
    params = grads = 0
    for m in models:
        for buf in m.grad_buffers:
            grads += _nbytes(buf.grad_data) + _nbytes(buf.grad_shard_data)
            grads += sum(_nbytes(b.grad_full) for b in buf.buckets)
            if buf.param_data is None and buf.param_shard_data is None:  # no distributed optimizer
                params += sum(p.numel() * p.element_size() for p in buf.params)
            else:
                params += _nbytes(buf.param_data) + _nbytes(buf.param_shard_data)
                params += sum(_nbytes(b.param_full) for b in buf.buckets)
    return {"params": params, "grads": grads, "optimizer": optimizer.state_bytes(),
            "optimizer_host": optimizer.host_state_bytes()}


@dataclass(frozen=True)
class StateShares:
    params: float
    grads: float
    optimizer: float


def predicted_state_bytes(n: int, dp: int, level: int, param_bytes: int = 4, grad_bytes: int = 4,
                          mixed: bool = False) -> StateShares:
    """Bytes per rank for ``n`` parameters (one gradient buffer group of ``dp`` ranks; padding ignored) at
    sharding ``level`` (0 no_shard, 1 optim, 2 optim_grads, 3 optim_grads_params): Adam's two fp32 moments,
    plus an fp32 master copy when the parameters are bf16/fp16 (``mixed``)."""
    opt = n * (8 + (4 if mixed else 0))
    return StateShares(params=n * param_bytes / (dp if level >= 3 else 1),
                       grads=n * grad_bytes / (dp if level >= 2 else 1),
                       optimizer=opt / (dp if level >= 1 else 1))
