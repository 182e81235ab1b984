"""Point-to-point transfers between pipeline stages: activations go to the next stage, their
gradients come back to the previous one. NCCL on GPUs, gloo on CPUs.

Shapes are known ahead: every transfer is one micro-batch's hidden states, ``[s, b, h]``, or
``[s/TP, b, h]`` with sequence parallelism, in the parameters' dtype; the receiver allocates its
buffer before the data arrives and no shape is ever exchanged. A sent tensor of any other shape or
dtype is an error on the sender, never a silent mismatch on the receiver.

Everything a stage sends and receives in one schedule slot goes out as one batch
(``torch.distributed.batch_isend_irecv``) in a fixed order, activations before gradients. Where one
peer is both the previous and the next stage (2 stages with interleaving), the two ends of the pair
therefore list their sends and receives in the same order, which NCCL needs (it matches messages
between a pair by order); gloo matches by tag as well (activations 0, gradients 1).

A peer that died or stopped answering is an error naming its rank. On CPU (gloo) each wait is
bounded by ``timeout`` seconds. On GPU (NCCL) the waits are stream waits that do not block the host;
a stuck peer is then caught by the process group's own timeout (``--distributed-timeout-minutes``),
enforced by the NCCL watchdog.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .dims import ParallelDims

ACT_TAG, GRAD_TAG = 0, 1


class PipelineError(RuntimeError):
    """A pipeline peer failed or did not answer in time, or a stage sent the wrong tensor."""


class P2P:
    """Transfers of one pipeline rank with its previous and next stage (wrapping: the last stage's
    next is the first, which interleaving uses)."""

    def __init__(self, dims: ParallelDims, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timeout: float = 600.0):
        self.dims, self.shape, self.dtype, self.device = dims, tuple(shape), dtype, torch.device(device)
        self.timeout = float(timeout)
        self.group = dims.pp_group
        self.prev_rank, self.next_rank = dims.pp_peer(-1), dims.pp_peer(+1)
        self.wait_seconds = 0.0  # host time spent waiting (CPU); see the schedule for GPU timing

    def _where(self) -> str:
        return f"pipeline stage {self.dims.pp_rank} (rank {self.dims.rank})"

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise PipelineError(
                f"{self._where()} would send {what} of shape {tuple(t.shape)} {t.dtype}, but the pipeline moves "
                f"{self.shape} {self.dtype} ([sequence (/TP with sequence parallelism), micro-batch, hidden] in the "
                "parameters' dtype); every micro-batch must be --micro-batch-size x --seq-length tokens")
        return t.contiguous()

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send_act: Optional[torch.Tensor] = None, send_grad: Optional[torch.Tensor] = None,
                 recv_act: bool = False, recv_grad: bool = False):
        """Send an activation to the next stage and/or a gradient to the previous one; receive an
        activation from the previous stage and/or a gradient from the next one. Returns the received
        (activation, gradient), None where nothing was asked."""
        ops, peers = [], []
        act = grad = None
        if send_act is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_act, "an activation"), self.next_rank, self.group,
                                  ACT_TAG))
            peers.append(("sending an activation to", self.next_rank))
        if recv_act:
            act = self._buffer()
            ops.append(dist.P2POp(dist.irecv, act, self.prev_rank, self.group, ACT_TAG))
            peers.append(("receiving an activation from", self.prev_rank))
        if send_grad is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_grad, "a gradient"), self.prev_rank, self.group,
                                  GRAD_TAG))
            peers.append(("sending a gradient to", self.prev_rank))
        if recv_grad:
            grad = self._buffer()
            ops.append(dist.P2POp(dist.irecv, grad, self.next_rank, self.group, GRAD_TAG))
            peers.append(("receiving a gradient from", self.next_rank))
        if ops:
            self._wait(dist.batch_isend_irecv(ops), peers)
        return act, grad

    def _wait(self, works: list, peers: list) -> None:
        if self.device.type == "cuda":  # stream waits: the host runs on; NCCL's watchdog bounds the time
            for w in works:
                w.wait()
            return
        start = time.perf_counter()
        if len(works) != len(peers):  # a backend that coalesced the batch into one request
            peers = [("exchanging with", f"{self.prev_rank}/{self.next_rank}")] * len(works)
        for w, (doing, peer) in zip(works, peers):
            try:
                ok = w.wait(timedelta(seconds=self.timeout))
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    raise PipelineError(f"{self._where()}: lost rank {peer} while {doing} it: {detail}") from None
                ok = False
            if ok is False:
                raise PipelineError(f"{self._where()}: timed out after {self.timeout:g} s {doing} rank {peer}; "
                                    f"is rank {peer} alive and running the same schedule?")
        self.wait_seconds += time.perf_counter() - start
