"""Expert parallelism: taking each token to the ranks that hold its experts, and its outputs back.

The experts of an MoE layer are split over the expert-parallel group ``ep`` (EP rank j holds the
``L = E / EP`` experts ``[j L, (j+1) L)``) and each expert's FFN over the expert-tensor-parallel
group ``etp`` (fc1 by output columns, fc2 by input rows, so fc2's outputs are partial sums). Both
dispatchers move tokens over the group ``etp_ep`` (the G = ETP x EP ranks that together hold one
copy of every expert; index ``etp + ETP * ep``). The tokens a rank starts with are its own: dense
data/tensor/sequence parallelism has already split the batch (with tensor parallelism and no
sequence parallelism the MoE layer splits the sequence over TP first, see ``moe.MoELayer``).

alltoall (default): the rank counts its tokens per expert; one all-gather of those counts over
``etp_ep`` and one device-to-host copy of the [G, E] table give every split size (this copy is the
one host synchronisation per layer and forward that an all-to-all with uneven splits needs; backward
reuses the sizes). The token rows, sorted by expert, are sent with ``all_to_all_single`` to the ETP
ranks of the EP rank holding their expert (each ETP rank gets the same rows), the received rows are
reordered by local expert, the experts run, and the reverse all-to-all brings the (partial) outputs
back, where the ETP parts are summed, weighted by the router probabilities and added per token.
With ``meanwhile`` (--moe-shared-expert-overlap) the dispatch all-to-all is started asynchronously and
``meanwhile()`` (the shared expert) runs before the wait; with experts that ask for it
(--moe-permute-fusion) the received rows go into the padded grouped layout by one gather.

allgather: the tokens, probabilities and routing maps of the group are all-gathered; each rank runs
its local experts on the gathered tokens routed to them and a reduce-scatter returns every rank the
sum over the group for its own tokens (no split sizes, so no exchange of counts; more traffic).

Backward of every collective is its mirror (all-to-all with the splits swapped, all-gather <->
reduce-scatter), written as autograd functions here and in ``comm``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import comm

_all_gather = comm.all_gather_single


@dataclass(frozen=True)
class ExpertLayout:
    """Where a layer's experts live, seen from this rank."""
    num_experts: int
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    group: object = None  # the etp x ep process group (None: one rank)

    @classmethod
    def from_dims(cls, dims, num_experts: int) -> "ExpertLayout":
        if dims is None:
            return cls(num_experts)
        return cls(num_experts, dims.size("ep"), dims.size("etp"), dims.coordinate("ep"), dims.coordinate("etp"),
                   dims.group("etp_ep"))

    @property
    def size(self) -> int:
        return self.ep * self.etp

    @property
    def local(self) -> int:
        """Experts on this rank."""
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        """Global index of this rank's first expert."""
        return self.ep_rank * self.local


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, turn: Optional[Callable]):
    """``all_to_all_single``; with ``turn`` (--overlap-moe-expert-parallel-comm's schedule) started
    asynchronously and ``turn()`` called while the rows travel (the other micro-batch's work runs), then waited."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if turn is None:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out
    handle = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    turn()
    handle.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, turn):
        ctx.splits, ctx.group, ctx.turn = (in_splits, out_splits), group, turn
        return _exchange(x, out_splits, in_splits, group, turn)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g.contiguous(), out_splits, in_splits, ctx.group, ctx.turn), None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               turn: Optional[Callable] = None) -> torch.Tensor:
    """Rows ``[sum(in_splits[:r]), +in_splits[r])`` of ``x`` go to rank r of ``group``; the result holds
    what each rank sent here, in rank order (``out_splits[r]`` rows from rank r). ``turn``: see :func:`_exchange`
    (forward and backward)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, turn)


class _Pending:
    """The reverse all-to-all of one overlapped dispatch in backward: started by :class:`_Arrived`, waited for by
    :class:`_Sent` (one per call, nothing shared between calls)."""

    def __init__(self):
        self.handle = None


class _Sent(torch.autograd.Function):
    """The rows an overlapped all-to-all sends, as they are; backward waits for the reverse all-to-all that
    :class:`_Arrived`'s backward started, then passes on the gradient it delivered."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.pending.handle is not None:
            ctx.pending.handle.wait()
            ctx.pending.handle = None
        return g, None


class _Arrived(torch.autograd.Function):
    """The rows an asynchronous all-to-all has delivered (``received``), joined to the graph of the rows sent
    (``x``, :class:`_Sent`'s output): backward starts sending the gradients back with the splits swapped,
    asynchronously, into a buffer that :class:`_Sent`'s backward waits for."""

    @staticmethod
    def forward(ctx, x, received, out_splits, in_splits, group, pending):
        ctx.splits, ctx.group, ctx.pending = (in_splits, out_splits), group, pending
        return received

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        out = g.new_empty((sum(out_splits),) + tuple(g.shape[1:]))
        ctx.pending.handle = dist.all_to_all_single(out, g.contiguous(), out_splits, in_splits, group=ctx.group,
                                                    async_op=True)
        return out, None, None, None, None, None


def all_to_all_overlapped(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                          meanwhile: Callable):
    """:func:`all_to_all` started asynchronously, ``meanwhile()`` computed while the rows travel, then the
    wait: (the rows received, what ``meanwhile`` returned). In backward the gradients go back asynchronously too,
    under ``meanwhile``'s backward: autograd runs the ready node created last first, so after :class:`_Arrived`
    (created after ``meanwhile``'s graph) starts the reverse all-to-all, ``meanwhile``'s nodes run before
    :class:`_Sent` (created before them) waits for it. The rows sent must have no other use in the graph (their
    gradient is the buffer being filled until that wait)."""
    pending = _Pending()
    sent = _Sent.apply(x, pending)
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    handle = dist.all_to_all_single(out, sent.detach().contiguous(), list(out_splits), list(in_splits), group=group,
                                    async_op=True)
    side = meanwhile()
    handle.wait()
    return _Arrived.apply(sent, out, list(out_splits), list(in_splits), group, pending), side


def aligned_rows(counts: torch.Tensor, expert_index: torch.Tensor, align: int = 8):
    """A layout for grouped GEMM with each expert's rows starting at a multiple of ``align`` (what
    the CUDA kernels want of the token dimension, as torchtitan pads it): the padded row of each
    sorted row, the padded group ends (int32), and a row count that bounds them without a host sync (a
    multiple of ``align``). An expert without rows still gets ``align`` zero rows (as torchtitan's padding): torch's
    Hopper grouped GEMMs do not promise to write the weight gradient of an empty group, which a group of zero rows
    makes exactly zero."""
    padded = torch.clamp_min((counts + align - 1) // align * align, align)
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # padded start - start, per expert
    dest = torch.arange(expert_index.numel(), device=counts.device) + shift[expert_index]
    bound = expert_index.numel() + counts.numel() * align
    return dest, ends.to(torch.int32), -(-bound // align) * align  # whole multiples: 16-byte strides of transposes


def _fused_rows(experts, x: torch.Tensor, row_expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """--moe-permute-fusion on the received rows (in [source][local expert] order): one gather takes them
    straight into the padded grouped layout, the experts run there (``experts.padded``), and one copy puts
    each output back at its received row (padding rows all land on one spare row, dropped)."""
    order = torch.argsort(row_expert, stable=True)
    dest, ends, size = aligned_rows(counts, row_expert[order], experts.row_alignment())
    received = x.shape[0]
    src = torch.full((size,), received, dtype=torch.long, device=x.device).index_copy(0, dest, order)
    padded_expert = torch.zeros(size, dtype=torch.long, device=x.device).index_copy(0, dest, row_expert[order])
    y = experts.padded(torch.nn.functional.pad(x, (0, 0, 0, 1))[src], ends, padded_expert)
    return y.new_zeros(received + 1, y.shape[1]).index_copy(0, src, y)[:-1]


def _sorted_rows(routing_map: torch.Tensor, total: int):
    """(expert, token) of each routed pair, sorted by expert then token; ``total`` pairs (known on the
    host, so no synchronisation where ``nonzero_static`` exists)."""
    flat = routing_map.t().reshape(-1)
    try:
        idx = torch.nonzero_static(flat, size=total).squeeze(1)
    except (AttributeError, NotImplementedError, RuntimeError):  # a build or device without it
        idx = flat.nonzero().squeeze(1)
    tokens = routing_map.shape[0]
    return idx // tokens, idx % tokens


def _count_table(routing_map: torch.Tensor, lay: ExpertLayout, capacity: Optional[int]):
    """Rows per (rank, expert) of the group, on the device and on the host: exchanged and read back (the
    one host synchronisation), or with ``capacity`` (every rank's routing padded to it) known as it is."""
    g, n_exp = lay.size, lay.num_experts
    if capacity is not None:
        return (torch.full((g, n_exp), capacity, dtype=torch.long, device=routing_map.device),
                [[capacity] * n_exp for _ in range(g)])
    counts = routing_map.sum(dim=0)
    table_dev = counts.new_empty(g * n_exp)
    _all_gather(table_dev, counts, group=lay.group)
    table_dev = table_dev.view(g, n_exp)
    return table_dev, table_dev.tolist()


def alltoall_dispatch(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                      run_experts: Callable, lay: ExpertLayout, meanwhile: Optional[Callable] = None,
                      capacity: Optional[int] = None, turn: Optional[Callable] = None):
    """The MoE layer's expert part over ``lay.group`` with all-to-all (see the module docstring).
    ``run_experts(x, counts, expert_index, host_counts)`` runs the local experts on rows sorted by
    local expert. Returns [tokens, hidden]; with ``meanwhile`` (--moe-shared-expert-overlap: the shared
    expert), (that, what ``meanwhile()`` returned, computed while the dispatch all-to-all is in flight).
    ``capacity``: every rank routes exactly that many rows to each expert (--moe-pad-expert-input-to-capacity):
    no count exchange and no host read. ``turn``: both all-to-alls (and their backward) hand the turn to the other
    micro-batch while their rows travel (--overlap-moe-expert-parallel-comm, parallel/turns.py)."""
    loc, g, etp = lay.local, lay.size, lay.etp
    table_dev, table = _count_table(routing_map, lay, capacity)
    me = lay.etp_rank + etp * lay.ep_rank
    mine = table[me]
    per_ep = [sum(mine[j * loc:(j + 1) * loc]) for j in range(lay.ep)]
    expert_index, token_index = _sorted_rows(routing_map, sum(mine))
    x = tokens[token_index]
    send = [per_ep[d // etp] for d in range(g)]  # destination d = etp rank + ETP x EP rank
    if etp > 1:  # every ETP rank of an EP rank gets that EP rank's rows
        x = torch.cat([part for part in x.split(per_ep) for _ in range(etp)])
    local_table = [row[lay.first:lay.first + loc] for row in table]  # [source][local expert]
    recv = [sum(row) for row in local_table]
    if meanwhile is not None:
        x, side = all_to_all_overlapped(x, recv, send, lay.group, meanwhile)
    else:
        x = all_to_all(x, recv, send, lay.group, turn)
    # rows arrive as [source][local expert]; the experts want [local expert][source]
    per_source = [[row[e] for row in local_table] for e in range(loc)]
    # --deterministic-mode: one matmul per (expert, source rank) in the experts' per-expert loop (Experts._mm)
    host_counts = per_source if g > 1 and torch.are_deterministic_algorithms_enabled() else [sum(c) for c in per_source]
    local_dev = table_dev[:, lay.first:lay.first + loc]
    order = None
    row_expert = torch.repeat_interleave(torch.arange(loc, device=x.device).repeat(g), local_dev.reshape(-1),
                                         output_size=sum(recv))
    if getattr(run_experts, "permute_fusion", False) and run_experts.takes_grouped(x):
        y = _fused_rows(run_experts, x, row_expert, local_dev.sum(dim=0))
    else:
        if loc > 1:
            order = torch.argsort(row_expert, stable=True)
            x, row_expert = x[order], row_expert[order]
        y = run_experts(x, local_dev.sum(dim=0), row_expert, host_counts)
        if order is not None:
            y = torch.empty_like(y).index_copy(0, order, y)
    y = all_to_all(y, send, recv, lay.group, turn)
    if etp > 1:  # sum the ETP ranks' partial outputs of each EP rank's rows
        parts = y.split(send)
        y = torch.cat([sum(parts[j * etp:(j + 1) * etp]) for j in range(lay.ep)])
    y = y * probs[token_index, expert_index].to(y.dtype)[:, None]
    out = torch.zeros_like(tokens).index_add_(0, token_index, y)
    return out if meanwhile is None else (out, side)


def allgather_dispatch(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                       run_experts: Callable, lay: ExpertLayout) -> torch.Tensor:
    """The MoE layer's expert part over ``lay.group`` with all-gather and reduce-scatter."""
    x_all = comm.gather_from_sp(tokens, lay.group)
    probs_all = comm.gather_from_sp(probs, lay.group)
    map_all = torch.empty(routing_map.numel() * lay.size, dtype=torch.uint8, device=routing_map.device)
    _all_gather(map_all, routing_map.contiguous().view(torch.uint8).view(-1), group=lay.group)
    map_all = map_all.view(torch.bool).view(-1, routing_map.shape[1])
    local_map = map_all[:, lay.first:lay.first + lay.local]
    expert_index, token_index = local_map.t().nonzero(as_tuple=True)
    counts = local_map.sum(dim=0)
    y = run_experts(x_all[token_index], counts, expert_index, None)
    y = y * probs_all[token_index, lay.first + expert_index].to(y.dtype)[:, None]
    out = torch.zeros_like(x_all).index_add_(0, token_index, y)
    return comm.reduce_scatter_to_sp(out, lay.group)


DISPATCHERS = {"alltoall": alltoall_dispatch, "allgather": allgather_dispatch}
