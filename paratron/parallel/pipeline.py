"""Schedules behind ``get_forward_backward_func()``, with Megatron's calling convention:

    forward_step_func(data_iterator, model) -> (output, loss_func)
    loss_func(output) -> (loss_sum, num_tokens, {"lm loss": tensor([sum, n])})

What each micro-batch backpropagates is ``layout.microbatch_loss`` (layout.py): by default its loss
divided by its token count and by the number of micro-batches (Megatron's
``calculate_per_token_loss=False``), with ``--calculate-per-token-loss`` the loss sum (the caller
then divides the gradients by the step's token count: ``finalize_model_grads(..., num_tokens)``).
Without a layout (PP = 1 only) the default applies. The schedule returns the list of report dicts
of the micro-batches (on the last pipeline stage; an empty list on the others).

Pipelined schedules (PP > 1) take ``model`` as the list of this rank's model chunks (one per virtual
stage, see stages.py), ``data_iterator`` as one iterator (each chunk then reads every micro-batch of
it in order) or a list of one per chunk, and ``layout``, a ``BatchLayout`` whose ``p2p_specs()`` say
what travels between stages (``seq_length`` and ``micro_batch_size`` are accepted for Megatron's
signature; the layout decides). A schedule is a table per rank, the order of its forwards and
backwards (1F1B: ``PP - rank - 1`` warm-up forwards, then one forward and one backward in turn, then
the backwards left; interleaved: the same over the chunks in Megatron's order, micro-batches in groups of
G = ``--microbatch-group-size-per-virtual-pipeline-stage`` (default PP), warm-up ``2 (PP - rank - 1) + (V - 1) G``).
``build_plan`` places every rank's actions on a common clock of slots, each action as early as its
input allows; in each slot a rank runs its action, then exchanges in one batch what was produced in
that slot with its two neighbours, which do the same in the same slot. Every exchange thus pairs with
exchanges its peers post in the same slot, so no order of arrival can deadlock, and the plan is
checked to finish before anything runs. Once a stage has sent an output activation, its storage is
freed (``deallocate_output_tensor``, Megatron's): only its autograd node is kept for the backward.
With --overlap-moe-expert-parallel-comm (interleaved) 1F1B runs one more warm-up forward and pairs each
steady-state forward with the backward after it in one slot ("FB"), the two taking turns at the expert all-to-alls
(turns.py).
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
from .layout import BatchLayout
from .p2p import P2P, PipelineError
from .stages import unwrap
from .turns import forward_backward_combined, microbatch_forward, settle_weight_grads, taking_turns, turn_takers


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator, model,
                                   num_microbatches: int, seq_length: int = 0, micro_batch_size: int = 0,
                                   layout: Optional[BatchLayout] = None, forward_only: bool = False,
                                   grad_scale: float = 1.0, **_unused) -> list[dict]:
    """Gradient accumulation over micro-batches on one pipeline stage."""
    if isinstance(model, (list, tuple)):
        (model,) = model
    reports = []
    no_sync = getattr(model, "no_sync", None)  # DataParallel: no gradient reduction before the last micro-batch
    for i in range(num_microbatches):
        defer = no_sync is not None and not forward_only and i < num_microbatches - 1
        with no_sync() if defer else contextlib.nullcontext():
            with torch.set_grad_enabled(not forward_only):
                loss, report = microbatch_forward(forward_step_func, data_iterator, model, layout, num_microbatches)
            if not forward_only:
                (loss * grad_scale).backward()
        reports.append(report)
    return reports


def get_forward_backward_func(dims: Optional[ParallelDims] = None, p2p_timeout: float = 600.0,
                              overlap_moe_comm: bool = False) -> Callable:
    """No pipelining at PP = 1; 1F1B at PP > 1; interleaved 1F1B with virtual stages (``dims.vpp`` > 1).
    ``p2p_timeout``: seconds a stage waits for a peer on CPU/gloo before failing (see p2p.py).
    ``overlap_moe_comm`` (--overlap-moe-expert-parallel-comm): a forward beside an earlier micro-batch's backward,
    taking turns at the expert all-to-alls (parallel/turns.py; at PP > 1 in 1F1B's steady-state slots)."""
    pp = dims.pp if dims is not None else 1
    if pp == 1:
        if overlap_moe_comm:
            return functools.partial(forward_backward_combined, plain=forward_backward_no_pipelining)
        return forward_backward_no_pipelining
    return PipelineSchedule(dims, p2p_timeout, turns=overlap_moe_comm)


# ---- tables: the order of forwards and backwards on one rank --------------------------------------
# An action is ("F" or "B", model chunk, micro-batch).

def table_1f1b(pp: int, rank: int, num_microbatches: int, forward_only: bool = False, ahead: int = 0,
               turns: bool = False) -> list[tuple]:
    """``ahead``: warm-up forwards beyond 1F1B's ``PP - rank - 1`` (1 with the turns: each steady-state forward then
    belongs to a later micro-batch than the backward beside it, on every stage the last one included); ``turns``:
    each steady-state pair as one "FB" action."""
    m = num_microbatches
    if forward_only:
        return [("F", 0, i) for i in range(m)]
    warmup = min(pp - rank - 1 + ahead, m)
    acts = [("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        acts += paired(("F", 0, warmup + k), ("B", 0, k)) if turns else [("F", 0, warmup + k), ("B", 0, k)]
    return acts + [("B", 0, i) for i in range(m - warmup, m)]


def interleaved_warmup(pp: int, vpp: int, rank: int, num_microbatches: int, group: Optional[int] = None) -> int:
    """Forwards before the first backward (Megatron: all of them when micro-batches = PP):
    ``2 (PP - rank - 1) + (V - 1) G`` for micro-batch groups of G (default PP)."""
    total = num_microbatches * vpp
    if num_microbatches == pp:
        return total
    return min(2 * (pp - rank - 1) + (vpp - 1) * (group or pp), total)


def forward_order(vpp: int, num_microbatches: int, group: int) -> list[tuple]:
    """The interleaved schedule's forwards as (chunk, micro-batch), Megatron's order: micro-batches in
    consecutive groups of ``group`` (the last group takes what is left), each group through chunk 0,
    then chunk 1, ...; the backwards take the same order with the chunks reversed."""
    order = []
    for start in range(0, num_microbatches, group):
        order += [(c, m) for c in range(vpp) for m in range(start, min(start + group, num_microbatches))]
    return order


def table_interleaved(pp: int, vpp: int, rank: int, num_microbatches: int, forward_only: bool = False,
                      group: Optional[int] = None, turns: bool = False) -> list[tuple]:
    """1F1B over the virtual stages: the warm-up forwards, then one forward and one backward in turn, then
    the backwards left (``--microbatch-group-size-per-virtual-pipeline-stage`` = ``group``, default PP).
    ``turns``: one more warm-up forward, and each steady-state forward and backward as one "FB" action."""
    order = forward_order(vpp, num_microbatches, group or pp)
    fwd = [("F", c, m) for c, m in order]
    bwd = [("B", vpp - 1 - c, m) for c, m in order]
    if forward_only:
        return fwd
    warmup = min(interleaved_warmup(pp, vpp, rank, num_microbatches, group) + (1 if turns else 0), len(order))
    acts = fwd[:warmup]
    for k in range(len(order) - warmup):
        acts += paired(fwd[warmup + k], bwd[k]) if turns else [fwd[warmup + k], bwd[k]]
    return acts + bwd[len(order) - warmup:]


def paired(f: tuple, b: tuple) -> list[tuple]:
    """A forward and a backward as one "FB" action (run taking turns), or in turn where they are the same
    micro-batch (a backward may need its own forward)."""
    return [("FB", f[1:], b[1:])] if f[2] != b[2] else [f, b]


def action_parts(action: tuple) -> list[tuple]:
    """The plain actions ("F" or "B", chunk, micro-batch) of a table entry: an "FB" action's two, else itself."""
    return [("F", *action[1]), ("B", *action[2])] if action[0] == "FB" else [action]


def schedule_table(pp: int, vpp: int, rank: int, num_microbatches: int, forward_only: bool = False,
                   group: Optional[int] = None, turns: bool = False) -> list[tuple]:
    """``turns`` (--overlap-moe-expert-parallel-comm): one more warm-up forward, then each steady-state forward and
    the backward after it as one action ("FB", (chunk, micro-batch) forward, (chunk, micro-batch) backward), run
    taking turns (turns.py)."""
    if vpp > 1:
        return table_interleaved(pp, vpp, rank, num_microbatches, forward_only, group, turns)
    return table_1f1b(pp, rank, num_microbatches, forward_only, ahead=1 if turns else 0, turns=turns)


def check_pipeline_schedule(dims: ParallelDims, num_microbatches: int) -> None:
    """Layout checks that need the number of micro-batches per step (known once DP is)."""
    m, pp, group = num_microbatches, dims.pp, dims.vpp_group or dims.pp
    if m < 1:
        raise ConfigError(f"a step needs at least one micro-batch per data-parallel rank (got {m})")
    if pp == 1 or (dims.vpp or 1) == 1:
        return
    if dims.vpp_group is None and m % pp:
        raise ConfigError(
            f"the interleaved pipeline schedule needs the micro-batches per step ({m} = --global-batch-size / "
            f"(--micro-batch-size x data-parallel size)) to be a multiple of --pipeline-model-parallel-size {pp}; "
            "change --global-batch-size")
    if not pp <= group <= m:
        raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage {group} must be between "
                          f"--pipeline-model-parallel-size {pp} and the micro-batches per step ({m})")
    if 0 < m % group < pp:
        raise ConfigError(f"the micro-batches per step ({m}) leave a last group of {m % group} (micro-batches mod "
                          f"--microbatch-group-size-per-virtual-pipeline-stage {group}), fewer than "
                          f"--pipeline-model-parallel-size {pp}; change --global-batch-size or the group size")


# ---- plan: every rank's actions on a common clock, with the transfers of each slot ---------------
class Slot(NamedTuple):
    t: int  # the slot's number on the common clock
    action: Optional[tuple]  # what this rank runs in the slot, if anything
    send: bool  # its output goes to a neighbour (activation after F, input gradient after B)
    recv_act: Optional[tuple]  # (chunk, micro-batch) whose input arrives from the previous stage
    recv_grad: Optional[tuple]  # (chunk, micro-batch) whose output gradient arrives from the next stage


@functools.lru_cache(maxsize=64)
def build_plan(pp: int, vpp: int, num_microbatches: int, forward_only: bool = False,
               group: Optional[int] = None, turns: bool = False) -> tuple:
    """For each rank, its slots in order (only those where it computes or receives something).
    Virtual stage s = chunk * PP + rank; F of stage s > 0 needs F of s - 1 done in an earlier slot,
    B of stage s < last needs B of s + 1 done in an earlier slot; each action takes the first slot
    after both its dependency and the rank's previous action. An "FB" action (``turns``) needs both of its
    parts' dependencies, and its slot's ``send`` is a pair (the forward's, the backward's)."""
    last = pp * vpp - 1
    tables = [schedule_table(pp, vpp, r, num_microbatches, forward_only, group, turns) for r in range(pp)]
    pos, prev_slot, slot_of = [0] * pp, [-1] * pp, {}
    slots = [dict() for _ in range(pp)]  # rank -> {slot: [action, send, recv_act, recv_grad]}
    waiting, todo = {}, list(range(pp))  # dependency -> the rank blocked on it; ranks to advance
    while todo:
        r = todo.pop()
        while pos[r] < len(tables[r]):
            action = tables[r][pos[r]]
            done = [(kind, c * pp + r, m) for kind, c, m in action_parts(action)]
            needs = [((("F", s - 1, m) if s > 0 else None) if kind == "F" else (("B", s + 1, m) if s < last else None))
                     for kind, s, m in done]
            unmet = [n for n in needs if n is not None and n not in slot_of]
            if unmet:
                waiting[unmet[0]] = r
                break
            t = max([prev_slot[r]] + [slot_of[n] for n in needs if n is not None]) + 1
            prev_slot[r] = t
            pos[r] += 1
            sends = []
            for (kind, s, m) in done:
                slot_of[(kind, s, m)] = t
                if (kind, s, m) in waiting:
                    todo.append(waiting.pop((kind, s, m)))
                dest = s + 1 if kind == "F" else s - 1
                sends.append(0 <= dest <= last)
                if sends[-1]:
                    slots[dest % pp].setdefault(t, [None, False, None, None])[2 if kind == "F" else 3] = (dest // pp, m)
            slots[r].setdefault(t, [None, False, None, None])[:2] = [action, tuple(sends) if len(sends) > 1
                                                                      else sends[0]]
    if any(pos[r] < len(tables[r]) for r in range(pp)):
        raise RuntimeError(f"pipeline schedule cannot proceed (PP {pp}, V {vpp}, {num_microbatches} micro-batches, "
                           f"stuck at {[tables[r][pos[r]] if pos[r] < len(tables[r]) else None for r in range(pp)]})")
    return tuple(tuple(Slot(k, *per[k]) for k in sorted(per)) for per in slots)


# ---- running a plan -------------------------------------------------------------------------------
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3, torch.int64: 4, torch.int32: 5,
               torch.bool: 6, torch.uint8: 7}
# The autograd engine's entry point (what torch.autograd.backward calls after its checks).
_run_backward = (getattr(torch.autograd.graph, "_engine_run_backward", None)
                 or torch.autograd.Variable._execution_engine.run_backward)


class _Viewless(torch.autograd.Function):
    """The same tensor (same storage, no copy) as one that is not a view, so that
    ``deallocate_output_tensor`` can free it: a view's storage is kept alive by its base (Megatron's
    ``make_viewless_tensor``, which its models apply to their output; paratron's schedule applies it
    to whatever a stage sends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((0,), dtype=x.dtype, device=x.device)
        out.data = x.data
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Megatron's: once a stage has sent its output activation, only the autograd node that produced
    it (``grad_fn``) is needed for the backward, not its values: replace its storage with an empty one
    (the activation of every micro-batch in flight would otherwise stay in memory twice, here and on
    the next stage). A view (its storage belongs to another tensor; see ``_Viewless``) or a leaf is
    left as it is."""
    if out.grad_fn is None or out._base is not None:
        return
    out.data = torch.empty((0,), device=out.device, dtype=out.dtype)


def backward_freed(outputs: list, grads: list) -> None:
    """Backward from outputs whose storage may have been freed by ``deallocate_output_tensor``.
    ``torch.autograd.backward`` would compare each gradient's shape with the emptied tensor; the
    autograd engine checks it against the shape recorded in the graph, so it is called directly
    (as Megatron's ``custom_backward``)."""
    _run_backward(tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _decode(body: list) -> str:
    """The spec list that ``PipelineSchedule._agree`` encoded, as text."""
    names = {code: str(dtype) for dtype, code in DTYPE_CODES.items()}
    out, i = [], 0
    while i < len(body):
        n = body[i]
        out.append(f"{tuple(body[i + 1: i + 1 + n])} {names.get(body[i + 1 + n], 'other dtype')}")
        i += n + 2
    return "[" + ", ".join(out) + "]"


class _Run:
    """One call of a pipelined schedule on this rank: its model chunks and data, and the tensors in
    flight, keyed by (chunk, micro-batch): received inputs and output gradients, and what a forward
    keeps for its backward (its inputs and outputs)."""

    def __init__(self, dims: ParallelDims, chunks: list, iters: list, forward_step_func: Callable,
                 layout: BatchLayout, specs: tuple, num_microbatches: int, forward_only: bool, grad_scale: float):
        self.dims, self.chunks, self.iters, self.step = dims, chunks, iters, forward_step_func
        self.layout, self.specs, self.m_total = layout, specs, num_microbatches
        self.forward_only, self.grad_scale = forward_only, grad_scale
        self.last = dims.pp * len(chunks) - 1
        self.inputs, self.grads, self.saved, self.reports = {}, {}, {}, []

    def stage(self, c: int) -> int:
        return c * self.dims.pp + self.dims.pp_rank

    def forward(self, c: int, m: int, send: bool) -> Optional[list]:
        """Forward of micro-batch m on chunk c; returns what goes to the next stage if ``send``."""
        stage = self.stage(c)
        xs = self.inputs.pop((c, m)) if stage > 0 else None
        if xs is not None and not self.forward_only:
            for x, spec in zip(xs, self.specs):
                x.requires_grad_(spec.has_grad)
        unwrap(self.chunks[c]).set_input_tensor(xs[0] if xs is not None and len(xs) == 1 else xs)
        with torch.set_grad_enabled(not self.forward_only):
            y, loss_func = self.step(self.iters[c], self.chunks[c])
            if stage == self.last:
                loss_sum, num_tokens, report = loss_func(y)
                self.reports.append(report)
                y = self.layout.microbatch_loss(loss_sum, num_tokens, self.m_total) * self.grad_scale
        outs = [y] if isinstance(y, torch.Tensor) else list(y)
        if not self.forward_only:
            if send:  # views cannot be freed after the send: the same tensors as non-views
                outs = [_Viewless.apply(o) if o._base is not None and o.requires_grad else o for o in outs]
            self.saved[(c, m)] = (xs, outs)
        return [o.detach() for o in outs] if send else None

    def sent(self, c: int, m: int) -> None:
        """The outputs of (c, m) have reached the next stage: free them."""
        if not self.forward_only:
            for out in self.saved[(c, m)][1]:
                deallocate_output_tensor(out)

    def backward(self, c: int, m: int, send: bool) -> Optional[list]:
        """Backward of micro-batch m on chunk c; returns its input gradients if ``send``."""
        xs, outs = self.saved.pop((c, m))
        defer = m < self.m_total - 1 and hasattr(self.chunks[c], "no_sync")  # reduce on the last micro-batch
        with self.chunks[c].no_sync() if defer else contextlib.nullcontext():
            if self.stage(c) == self.last:
                torch.autograd.backward(outs[0])
            else:
                pairs = [(o, g) for o, g in zip([o for o, s in zip(outs, self.specs) if s.has_grad],
                                                self.grads.pop((c, m))) if o.requires_grad]
                backward_freed([o for o, _ in pairs], [g for _, g in pairs])
        if not send:
            return None
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x, s in zip(xs, self.specs) if s.has_grad]

    def check_done(self) -> None:
        if self.inputs or self.grads or self.saved:
            raise RuntimeError(f"pipeline rank {self.dims.pp_rank}: the schedule left tensors behind (a bug)")
        for c in self.chunks:
            unwrap(c).set_input_tensor(None)


class PipelineSchedule:
    """1F1B, or interleaved 1F1B with virtual stages, for one ParallelDims; called like
    ``forward_backward_no_pipelining`` (with ``layout``). ``p2p_class`` makes the transfers (a
    benchmark may pass a subclass of P2P that times them)."""

    def __init__(self, dims: ParallelDims, p2p_timeout: float = 600.0, p2p_class: type = P2P, turns: bool = False):
        """``turns``: --overlap-moe-expert-parallel-comm (each steady-state forward and backward taking turns)."""
        self.dims, self.timeout, self.p2p_class, self.turns = dims, p2p_timeout, p2p_class, turns
        self.vpp = dims.vpp or 1
        self._p2p: dict = {}

    def _comm(self, layout: Optional[BatchLayout], num_microbatches: int) -> P2P:
        if layout is None:
            raise ValueError("pipelined schedules need layout=BatchLayout(...) (paratron/parallel/layout.py): "
                             "it says which tensors travel between stages")
        specs = tuple(layout.p2p_specs())
        key = (specs, layout.device, num_microbatches)
        if key not in self._p2p:
            self._agree(specs, layout.device, num_microbatches)
            self._p2p[key] = self.p2p_class(self.dims, specs, layout.device, self.timeout)
        return self._p2p[key]

    def _agree(self, specs: tuple, device, num_microbatches: int) -> None:
        """All stages must move the same tensors through the same plan; small all-reduces over the
        pipeline group check it (and are the group's first collectives, as NCCL's batched p2p wants):
        the sizes and the number of tensors and of their dimensions, then the shapes and dtypes."""
        body = [x for s in specs for x in (len(s.shape), *s.shape, DTYPE_CODES.get(s.dtype, len(DTYPE_CODES)))]
        lo, hi = self._min_max([self.dims.pp, self.vpp, num_microbatches, len(specs), len(body)], device)
        if lo == hi:  # the same number of tensors and dimensions: compare shapes and dtypes
            lo, hi = self._min_max(body, device)
            if lo == hi:
                return
            diff = [f"tensors {_decode(lo)}..{_decode(hi)}"]
        else:
            names = ["PP", "virtual stages", "micro-batches", "tensors", "tensor dimensions"]
            diff = [f"{n} {a}..{b}" for n, a, b in zip(names, lo, hi) if a != b]
        raise PipelineError(f"pipeline stages disagree on the layout ({', '.join(diff)}); every rank must run "
                            "the same configuration")

    def _min_max(self, values: list, device) -> tuple[list, list]:
        lo = torch.tensor(values, dtype=torch.int64, device=device)
        hi = lo.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.dims.pp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.dims.pp_group)
        return lo.tolist(), hi.tolist()

    def __call__(self, *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                 seq_length: int = 0, micro_batch_size: int = 0, layout: Optional[BatchLayout] = None,
                 forward_only: bool = False, grad_scale: float = 1.0, **_unused) -> list[dict]:
        d, vpp = self.dims, self.vpp
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != vpp:
            raise ValueError(f"pipeline rank {d.pp_rank} has {len(chunks)} model chunks; the layout has {vpp} "
                             "virtual stages")
        check_pipeline_schedule(d, num_microbatches)
        p2p = self._comm(layout, num_microbatches)
        if isinstance(data_iterator, (list, tuple)):
            iters = list(data_iterator)
        elif vpp > 1 and data_iterator is not None:  # each chunk reads every micro-batch, in order
            iters = list(itertools.tee(data_iterator, vpp))
        else:
            iters = [data_iterator] * vpp
        run = _Run(d, chunks, iters, forward_step_func, layout, p2p.specs, num_microbatches, forward_only,
                   grad_scale)
        takers = turn_takers(chunks) if self.turns else []
        for slot in build_plan(d.pp, vpp, num_microbatches, forward_only, d.vpp_group, self.turns)[d.pp_rank]:
            self._run_slot(run, slot, p2p, takers)
        if self.turns and not forward_only:
            settle_weight_grads(takers)
        run.check_done()
        return run.reports

    @staticmethod
    def _run_slot(run: _Run, slot: "Slot", p2p: P2P, takers: list) -> None:
        """This rank's action of the slot, then its exchange with the neighbours; ``takers``: the layers that take
        turns in an "FB" action (turns.py)."""
        act = grad = None
        if slot.action is not None and slot.action[0] == "FB":  # a forward and a backward, taking turns
            (c, m), back = slot.action[1:]
            out: dict = {}
            with taking_turns(takers) as turns:
                turns.run(lambda: out.update(act=run.forward(c, m, slot.send[0])),
                          lambda: out.update(grad=run.backward(*back, slot.send[1])))
            act, grad = out["act"], out["grad"]
        elif slot.action is not None:
            kind, c, m = slot.action
            if kind == "F":
                act = run.forward(c, m, slot.send)
            else:
                grad = run.backward(c, m, slot.send)
        got_act, got_grad = p2p.exchange(send_act=act, send_grad=grad, recv_act=slot.recv_act is not None,
                                         recv_grad=slot.recv_grad is not None)
        if act is not None:
            del act
            run.sent(c, m)
        if got_act is not None:
            run.inputs[slot.recv_act] = got_act
        if got_grad is not None:
            run.grads[slot.recv_grad] = got_grad
