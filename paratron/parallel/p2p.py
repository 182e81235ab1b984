"""Point-to-point transfers between pipeline stages: activations go to the next stage, their
gradients come back to the previous one. NCCL on GPUs, gloo on CPUs.

What travels is a list of ``TensorSpec`` (shape, dtype), the same on every stage: for the GPT model
one spec, the micro-batch's hidden states ``[s/CP/(TP with sequence parallelism), b, h]`` in the
parameters' dtype (``BatchLayout.p2p_specs()`` in layout.py says so), but a stage may pass several
tensors of different shapes. Each transfer moves one tensor per spec, in the list's order; gradients
come back for the floating-point specs only. The receiver allocates its buffers before the data
arrives and no shape is ever exchanged: a sent tensor of another shape or dtype than its spec is an
error on the sender, never a silent mismatch on the receiver. A different list of specs is a
different ``P2P`` object (the schedule keeps one per list).

Everything a stage sends and receives in one schedule slot goes out as one batch
(``torch.distributed.batch_isend_irecv``) in a fixed order: activations before gradients, and
within each the tensors in spec order. Where one peer is both the previous and the next stage (2
stages with interleaving), the two ends of the pair therefore list their sends and receives in the
same order, which NCCL needs (it matches messages between a pair by order); gloo matches by tag as
well (tensor i: activation 2i, gradient 2i + 1).

A peer that died or stopped answering is an error naming its rank. On CPU (gloo) each wait is
bounded by ``timeout`` seconds. On GPU (NCCL) the waits are stream waits that do not block the host;
a stuck peer is then caught by the process group's own timeout (``--distributed-timeout-minutes``),
enforced by the NCCL watchdog.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .dims import ParallelDims

ACT_TAG, GRAD_TAG = 0, 1  # tensor i of a transfer uses tag 2 i + ACT_TAG / 2 i + GRAD_TAG


class PipelineError(RuntimeError):
    """A pipeline peer failed or did not answer in time, or a stage sent the wrong tensor."""


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one tensor that travels between pipeline stages."""
    shape: tuple
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def has_grad(self) -> bool:
        """Its gradient travels back (floating-point tensors only)."""
        return self.dtype.is_floating_point


class P2P:
    """Transfers of one pipeline rank with its previous and next stage (wrapping: the last stage's
    next is the first, which interleaving uses), each transfer one tensor per spec of ``specs``."""

    def __init__(self, dims: ParallelDims, specs: Sequence[TensorSpec], device: torch.device,
                 timeout: float = 600.0):
        self.dims, self.specs, self.device = dims, tuple(specs), torch.device(device)
        if not self.specs:
            raise ValueError("a pipeline transfer needs at least one TensorSpec")
        self.grad_specs = tuple(s for s in self.specs if s.has_grad)
        self.timeout = float(timeout)
        self.group = dims.pp_group
        self.prev_rank, self.next_rank = dims.pp_peer(-1), dims.pp_peer(+1)

    def _where(self) -> str:
        return f"pipeline stage {self.dims.pp_rank} (rank {self.dims.rank})"

    def _check(self, tensors: Sequence[torch.Tensor], specs: tuple, what: str) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor) or len(tensors) != len(specs):
            n = 1 if isinstance(tensors, torch.Tensor) else len(tensors)
            raise PipelineError(f"{self._where()} would send {n} {what} tensor(s), but the pipeline moves "
                                f"{len(specs)}: a list of one tensor per TensorSpec {list(specs)}")
        for i, (t, spec) in enumerate(zip(tensors, specs)):
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                which = f" (tensor {i} of {len(specs)})" if len(specs) > 1 else ""
                raise PipelineError(
                    f"{self._where()} would send {'an' if what == 'activation' else 'a'} {what} of shape "
                    f"{tuple(t.shape)} {t.dtype}{which}, but the pipeline moves {spec.shape} {spec.dtype} "
                    "([sequence (/TP with sequence parallelism), micro-batch, hidden] in the parameters' dtype "
                    "for the GPT model); every micro-batch must be --micro-batch-size x --seq-length tokens")
        return [t.contiguous() for t in tensors]

    def _buffers(self, specs: tuple) -> list[torch.Tensor]:
        return [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]

    def exchange(self, send_act: Optional[Sequence[torch.Tensor]] = None,
                 send_grad: Optional[Sequence[torch.Tensor]] = None, recv_act: bool = False, recv_grad: bool = False):
        """Send activations (one tensor per spec) to the next stage and/or gradients (one per
        floating-point spec) to the previous one; receive activations from the previous stage and/or
        gradients from the next one. Returns the received (activations, gradients) as lists, None
        where nothing was asked."""
        ops, peers = [], []
        act = grad = None

        def post(op, tensors, peer, tag, doing):
            for i, t in enumerate(tensors):
                ops.append(dist.P2POp(op, t, peer, self.group, 2 * i + tag))
                peers.append((doing, peer))

        if send_act is not None:
            post(dist.isend, self._check(send_act, self.specs, "activation"), self.next_rank, ACT_TAG,
                 "sending an activation to")
        if recv_act:
            act = self._buffers(self.specs)
            post(dist.irecv, act, self.prev_rank, ACT_TAG, "receiving an activation from")
        if send_grad is not None:
            post(dist.isend, self._check(send_grad, self.grad_specs, "gradient"), self.prev_rank, GRAD_TAG,
                 "sending a gradient to")
        if recv_grad:
            grad = self._buffers(self.grad_specs)
            post(dist.irecv, grad, self.next_rank, GRAD_TAG, "receiving a gradient from")
        if ops:
            self._wait(dist.batch_isend_irecv(ops), peers)
        return act, grad

    def _wait(self, works: list, peers: list) -> None:
        if self.device.type == "cuda":  # stream waits: the host runs on; NCCL's watchdog bounds the time
            for w in works:
                w.wait()
            return
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
