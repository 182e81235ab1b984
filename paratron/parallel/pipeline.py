"""Schedules behind ``get_forward_backward_func()``, with Megatron's calling convention:

    forward_step_func(data_iterator, model) -> (output, loss_func)
    loss_func(output) -> (loss_sum, num_tokens, {"lm loss": tensor([sum, n])})

Each micro-batch's loss is divided by its token count and by the number of micro-batches (Megatron's
default, ``calculate_per_token_loss=False``). The schedule returns the list of report dicts of the
micro-batches (on the last pipeline stage; an empty list on the others).

Pipelined schedules (PP > 1) take ``model`` as the list of this rank's model chunks (one per virtual
stage, see stages.py) and ``data_iterator`` as one iterator (each chunk then reads every
micro-batch of it in order) or a list of one per chunk. A schedule is a table per rank, the order of
its forwards and backwards (1F1B: ``PP - rank - 1`` warm-up forwards, then one forward and one
backward in turn, then the backwards left; interleaved: the same over the chunks, warm-up
``2 (PP - rank - 1) + (V - 1) PP``). ``build_plan`` places every rank's actions on a common clock of
slots, each action as early as its input allows; in each slot a rank runs its action, then exchanges
in one batch what was produced in that slot with its two neighbours, which do the same in the same
slot. Every exchange thus pairs with exchanges its peers post in the same slot, so no order of
arrival can deadlock, and the plan is checked to finish before anything runs.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from .dims import ParallelDims
from .p2p import P2P, PipelineError
from .stages import unwrap


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator, model,
                                   num_microbatches: int, seq_length: int = 0, micro_batch_size: int = 0,
                                   forward_only: bool = False, grad_scale: float = 1.0,
                                   **_unused) -> list[dict]:
    """Gradient accumulation over micro-batches on one pipeline stage."""
    if isinstance(model, (list, tuple)):
        (model,) = model
    reports = []
    no_sync = getattr(model, "no_sync", None)  # DataParallel: no gradient reduction before the last micro-batch
    for i in range(num_microbatches):
        defer = no_sync is not None and not forward_only and i < num_microbatches - 1
        with no_sync() if defer else contextlib.nullcontext():
            with torch.set_grad_enabled(not forward_only):
                output, loss_func = forward_step_func(data_iterator, model)
                loss_sum, num_tokens, report = loss_func(output)
                loss = loss_sum / num_tokens.clamp(min=1) / num_microbatches
            if not forward_only:
                (loss * grad_scale).backward()
        reports.append(report)
    return reports


def get_forward_backward_func(dims: Optional[ParallelDims] = None, p2p_timeout: float = 600.0) -> Callable:
    """No pipelining at PP = 1; 1F1B at PP > 1; interleaved 1F1B with virtual stages (``dims.vpp`` > 1).
    ``p2p_timeout``: seconds a stage waits for a peer on CPU/gloo before failing (see p2p.py)."""
    pp = dims.pp if dims is not None else 1
    if pp == 1:
        return forward_backward_no_pipelining
    return PipelineSchedule(dims, p2p_timeout)


# ---- tables: the order of forwards and backwards on one rank --------------------------------------
# An action is ("F" or "B", model chunk, micro-batch).

def table_1f1b(pp: int, rank: int, num_microbatches: int, forward_only: bool = False) -> list[tuple]:
    m = num_microbatches
    if forward_only:
        return [("F", 0, i) for i in range(m)]
    warmup = min(pp - rank - 1, m)
    acts = [("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        acts += [("F", 0, warmup + k), ("B", 0, k)]
    return acts + [("B", 0, i) for i in range(m - warmup, m)]


def interleaved_warmup(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    """Forwards before the first backward (Megatron: all of them when micro-batches = PP)."""
    total = num_microbatches * vpp
    if num_microbatches == pp:
        return total
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)


def table_interleaved(pp: int, vpp: int, rank: int, num_microbatches: int, forward_only: bool = False) -> list[tuple]:
    """Micro-batches go through the chunks in groups of PP: forward k is chunk (k // PP) % V of
    micro-batch (k // (PP V)) PP + k % PP; backward k likewise with the chunks in reverse order."""
    group = pp * vpp
    total = num_microbatches * vpp

    def micro(k: int) -> int:
        return (k // group) * pp + k % pp

    def fwd(k: int) -> tuple:
        return ("F", (k % group) // pp, micro(k))

    def bwd(k: int) -> tuple:
        return ("B", vpp - 1 - (k % group) // pp, micro(k))

    if forward_only:
        return [fwd(k) for k in range(total)]
    warmup = interleaved_warmup(pp, vpp, rank, num_microbatches)
    acts = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        acts += [fwd(warmup + k), bwd(k)]
    return acts + [bwd(k) for k in range(total - warmup, total)]


def schedule_table(pp: int, vpp: int, rank: int, num_microbatches: int, forward_only: bool = False) -> list[tuple]:
    if vpp > 1:
        return table_interleaved(pp, vpp, rank, num_microbatches, forward_only)
    return table_1f1b(pp, rank, num_microbatches, forward_only)


def check_pipeline_schedule(dims: ParallelDims, num_microbatches: int) -> None:
    """Layout checks that need the number of micro-batches per step (known once DP is)."""
    if num_microbatches < 1:
        raise ConfigError(f"a step needs at least one micro-batch per data-parallel rank (got {num_microbatches})")
    if dims.pp > 1 and (dims.vpp or 1) > 1 and num_microbatches % dims.pp:
        raise ConfigError(
            f"the interleaved pipeline schedule needs the micro-batches per step ({num_microbatches} = "
            f"--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple of "
            f"--pipeline-model-parallel-size {dims.pp}; change --global-batch-size")


# ---- plan: every rank's actions on a common clock, with the transfers of each slot ---------------
class Slot(NamedTuple):
    t: int  # the slot's number on the common clock
    action: Optional[tuple]  # what this rank runs in the slot, if anything
    send: bool  # its output goes to a neighbour (activation after F, input gradient after B)
    recv_act: Optional[tuple]  # (chunk, micro-batch) whose input arrives from the previous stage
    recv_grad: Optional[tuple]  # (chunk, micro-batch) whose output gradient arrives from the next stage


@functools.lru_cache(maxsize=64)
def build_plan(pp: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> tuple:
    """For each rank, its slots in order (only those where it computes or receives something).
    Virtual stage s = chunk * PP + rank; F of stage s > 0 needs F of s - 1 done in an earlier slot,
    B of stage s < last needs B of s + 1 done in an earlier slot; each action takes the first slot
    after both its dependency and the rank's previous action."""
    last = pp * vpp - 1
    tables = [schedule_table(pp, vpp, r, num_microbatches, forward_only) for r in range(pp)]
    pos, prev_slot, slot_of = [0] * pp, [-1] * pp, {}
    slots = [dict() for _ in range(pp)]  # rank -> {slot: [action, send, recv_act, recv_grad]}
    waiting, todo = {}, list(range(pp))  # dependency -> the rank blocked on it; ranks to advance
    while todo:
        r = todo.pop()
        while pos[r] < len(tables[r]):
            kind, c, m = tables[r][pos[r]]
            s = c * pp + r
            need = (("F", s - 1, m) if s > 0 else None) if kind == "F" else (("B", s + 1, m) if s < last else None)
            if need is not None and need not in slot_of:
                waiting[need] = r
                break
            t = max(prev_slot[r], slot_of[need] if need is not None else -1) + 1
            slot_of[(kind, s, m)] = prev_slot[r] = t
            pos[r] += 1
            if (kind, s, m) in waiting:
                todo.append(waiting.pop((kind, s, m)))
            dest = s + 1 if kind == "F" else s - 1
            send = 0 <= dest <= last
            slots[r].setdefault(t, [None, False, None, None])[:2] = [(kind, c, m), send]
            if send:
                slots[dest % pp].setdefault(t, [None, False, None, None])[2 if kind == "F" else 3] = (dest // pp, m)
    if any(pos[r] < len(tables[r]) for r in range(pp)):
        raise RuntimeError(f"pipeline schedule cannot proceed (PP {pp}, V {vpp}, {num_microbatches} micro-batches, "
                           f"stuck at {[tables[r][pos[r]] if pos[r] < len(tables[r]) else None for r in range(pp)]})")
    return tuple(tuple(Slot(k, *per[k]) for k in sorted(per)) for per in slots)


# ---- running a plan -------------------------------------------------------------------------------
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}

class PipelineSchedule:
    """1F1B, or interleaved 1F1B with virtual stages, for one ParallelDims; called like
    ``forward_backward_no_pipelining``. ``measure_idle = True`` times every exchange (for
    benchmarks: ``idle_seconds()``)."""

    def __init__(self, dims: ParallelDims, p2p_timeout: float = 600.0):
        self.dims, self.timeout = dims, p2p_timeout
        self.vpp = dims.vpp or 1
        self._p2p: dict = {}
        self.measure_idle = False
        self._events: list = []
        self._idle_host = 0.0

    def _comm(self, chunk, seq_length: int, micro_batch_size: int, num_microbatches: int) -> P2P:
        m = unwrap(chunk)
        par = getattr(m, "par", None)
        split = par.tp_size if par is not None and par.sequence_parallel else 1
        if not seq_length or not micro_batch_size or seq_length % split:
            raise ValueError(f"pipelined schedules need seq_length and micro_batch_size (got {seq_length}, "
                             f"{micro_batch_size}) with seq_length divisible by {split}")
        p = next(m.parameters())
        shape = (seq_length // split, micro_batch_size, m.config.hidden_size)
        key = (shape, p.dtype, p.device, num_microbatches)
        if key not in self._p2p:
            self._agree(shape, p.dtype, p.device, num_microbatches)
            self._p2p[key] = P2P(self.dims, shape, p.dtype, p.device, self.timeout)
        return self._p2p[key]

    def _agree(self, shape, dtype, device, num_microbatches: int) -> None:
        """All stages must move the same tensors through the same plan; one small all-reduce over the
        pipeline group checks it (and is the group's first collective, as NCCL's batched p2p wants)."""
        d = self.dims
        code = DTYPE_CODES.get(dtype, len(DTYPE_CODES))
        mine = torch.tensor([d.pp, self.vpp, num_microbatches, *shape, code], device=device)
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=d.pp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=d.pp_group)
        if not torch.equal(lo, hi):
            names = ["PP", "virtual stages", "micro-batches", "sequence", "micro-batch", "hidden", "dtype code"]
            diff = [f"{n} {a}..{b}" for n, a, b in zip(names, lo.tolist(), hi.tolist()) if a != b]
            raise PipelineError(f"pipeline stages disagree on the layout ({', '.join(diff)}); every rank must run "
                                "the same configuration")

    def _exchange(self, p2p: P2P, **kw):
        if not self.measure_idle:
            return p2p.exchange(**kw)
        if p2p.device.type == "cuda":  # GPU time the compute stream waits for the transfer
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = p2p.exchange(**kw)
            end.record()
            self._events.append((start, end))
            return out
        before = p2p.wait_seconds
        out = p2p.exchange(**kw)
        self._idle_host += p2p.wait_seconds - before
        return out

    def idle_seconds(self) -> float:
        """Time spent waiting in transfers since the last call (synchronises the GPU)."""
        if self._events:
            torch.cuda.synchronize()
        total = self._idle_host + sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        self._events, self._idle_host = [], 0.0
        return total

    def __call__(self, *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                 seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
                 grad_scale: float = 1.0, **_unused) -> list[dict]:
        d, vpp, m_total = self.dims, self.vpp, num_microbatches
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != vpp:
            raise ValueError(f"pipeline rank {d.pp_rank} has {len(chunks)} model chunks; the layout has {vpp} "
                             "virtual stages")
        check_pipeline_schedule(d, m_total)
        p2p = self._comm(chunks[0], seq_length, micro_batch_size, m_total)
        if isinstance(data_iterator, (list, tuple)):
            iters = list(data_iterator)
        elif vpp > 1 and data_iterator is not None:  # each chunk reads every micro-batch, in order
            iters = list(itertools.tee(data_iterator, vpp))
        else:
            iters = [data_iterator] * vpp
        last = d.pp * vpp - 1
        inputs, grads, saved, reports = {}, {}, {}, []
        for slot in build_plan(d.pp, vpp, m_total, forward_only)[d.pp_rank]:
            act = grad = None
            if slot.action is not None:
                kind, c, m = slot.action
                stage = c * d.pp + d.pp_rank
                if kind == "F":
                    x = inputs.pop((c, m)) if stage > 0 else None
                    if x is not None and not forward_only:
                        x.requires_grad_(True)
                    unwrap(chunks[c]).set_input_tensor(x)
                    with torch.set_grad_enabled(not forward_only):
                        y, loss_func = forward_step_func(iters[c], chunks[c])
                        if stage == last:
                            loss_sum, num_tokens, report = loss_func(y)
                            reports.append(report)
                            y = loss_sum / num_tokens.clamp(min=1) / m_total * grad_scale
                    if not forward_only:
                        saved[(c, m)] = (x, y)
                    act = y.detach() if slot.send else None
                else:
                    x, y = saved.pop((c, m))
                    g = grads.pop((c, m)) if stage < last else None
                    defer = m < m_total - 1 and hasattr(chunks[c], "no_sync")  # reduce on the last micro-batch
                    with chunks[c].no_sync() if defer else contextlib.nullcontext():
                        torch.autograd.backward(y, grad_tensors=g)
                    if slot.send:
                        grad = x.grad if x.grad is not None else torch.zeros_like(x)
            got_act, got_grad = self._exchange(p2p, send_act=act, send_grad=grad, recv_act=slot.recv_act is not None,
                                               recv_grad=slot.recv_grad is not None)
            if got_act is not None:
                inputs[slot.recv_act] = got_act
            if got_grad is not None:
                grads[slot.recv_grad] = got_grad
        if inputs or grads or saved:
            raise RuntimeError(f"pipeline rank {d.pp_rank}: the schedule left tensors behind (a bug)")
        for c in chunks:
            unwrap(c).set_input_tensor(None)
        return reports
