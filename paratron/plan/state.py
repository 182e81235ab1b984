"""Bytes of model state one rank holds: weights, gradient buffers and optimizer state, counted the way
paratron/parallel/data.py lays the gradient buffers out (per model chunk, one buffer per gradient group and
tied pair; parameters in reverse module order, each start aligned to 64 elements, buckets padded to
64 x the group size) and paratron/optim shards them (ZeRO-1: each rank owns one equal shard of every
bucket). ZeRO-2 and ZeRO-3 (``--data-parallel-sharding-strategy optim_grads | optim_grads_params``) keep
only that shard of the gradients, and of the weights, between uses (ZeRO-3's buckets end where a decoder
layer, its unit of gathering, ends); ``--optimizer-offload-fraction`` moves
that share of the fp32 masters and Adam moments (with their gradients' fp32 copy) to the host."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from ..config import ModelConfig
from ..config.pipeline_split import chunk_layers
from .layout import Layout
from .shapes import Split, Tensor, chunk, layer_kinds

UNIT = re.compile(r"^(decoder|mtp)\.layers\.(\d+)\.")
MTP_UNITS = 1 << 20  # the ids of multi-token prediction's units: past any decoder layer's
ALIGN = 64  # paratron/parallel/data.py's alignment of parameters and shards
BUCKET_MIN, BUCKET_PER_RANK = 40_000_000, 1_000_000  # Megatron's default bucket with --overlap-grad-reduce
STEP_BYTES = 4  # torch's AdamW keeps one fp32 step counter per tensor it steps


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class Buffer:
    """One gradient buffer: its group size, padded size, real elements and, per rank of its group, the
    elements and pieces (parameter fragments) of that rank's shard; the largest bucket."""
    group: str
    n: int
    total: int = 0
    numel: int = 0
    shard_elems: list = field(default_factory=list)
    shard_pieces: list = field(default_factory=list)
    largest_bucket: int = 0
    count: int = 0  # parameters


def unit(name: str) -> int:
    """The ZeRO-3 unit of a parameter: its decoder layer (or multi-token prediction depth: every element of a
    top-level ModuleList is a unit), or -1 for the rest of the model (the root unit)."""
    match = UNIT.match(name)
    if match is None:
        return -1
    return int(match.group(2)) + (MTP_UNITS if match.group(1) == "mtp" else 0)


def spans_and_buckets(tensors: list[Tensor], n: int, bucket_size, by_unit: bool = False,
                      end_multiple: int = 1) -> tuple[list, list]:
    """[(start, end)] of each parameter and [(start, end)] of each bucket, as GradBuffer._layout (``by_unit``:
    ZeRO-3's buckets also end where the unit changes; each bucket's size a multiple of ALIGN x n and
    ``end_multiple``)."""
    spans, buckets, start, pos, open_, last = [], [], 0, 0, False, None
    unit_end = math.lcm(ALIGN * n, end_multiple)
    for t in reversed(tensors):
        here = unit(t.name) if by_unit else None
        if open_ and by_unit and here != last:
            end = round_up(pos, unit_end)
            buckets.append((start, end))
            start, pos = end, end
        last = here
        pos = round_up(pos, ALIGN)
        spans.append((pos, pos + t.numel))
        pos += t.numel
        open_ = True
        if bucket_size is not None and pos - start >= bucket_size:
            end = round_up(pos, unit_end)
            buckets.append((start, end))
            start, pos, open_ = end, end, False
    if open_:
        buckets.append((start, round_up(pos, unit_end)))
    return spans, buckets


def lay_out(tensors: list[Tensor], group: str, n: int, bucket_size, by_unit: bool = False,
            end_multiple: int = 1) -> Buffer:
    spans, buckets = spans_and_buckets(tensors, n, bucket_size, by_unit, end_multiple)
    buf = Buffer(group, n, buckets[-1][1] if buckets else 0, sum(t.numel for t in tensors))
    buf.shard_elems, buf.shard_pieces = [0] * n, [0] * n
    buf.largest_bucket = max((e - s for s, e in buckets), default=0)
    buf.count = len(tensors)
    elems, pieces = [0] * (n + 1), [0] * (n + 1)  # difference arrays over the shards of a bucket
    it = iter(spans)
    span = next(it, None)
    for s, e in buckets:
        size = (e - s) // n
        while span is not None and span[0] < e:
            a, b = span
            r0, r1 = (a - s) // size, (b - 1 - s) // size
            pieces[r0] += 1
            pieces[r1 + 1] -= 1
            if r0 == r1:
                buf.shard_elems[r0] += b - a
            else:  # partial first and last shards, whole shards between
                buf.shard_elems[r0] += s + (r0 + 1) * size - a
                buf.shard_elems[r1] += b - (s + r1 * size)
                elems[r0 + 1] += size
                elems[r1] -= size
            span = next(it, None)
    run_e = run_p = 0
    for r in range(n):
        run_e, run_p = run_e + elems[r], run_p + pieces[r]
        buf.shard_elems[r] += run_e
        buf.shard_pieces[r] = run_p
    return buf


def bucket_size_of(layout: Layout, n: int, rank_params: int = 0):
    """As paratron/parallel/data.py sizes them: --ddp-bucket-size, or the rank's parameters (``rank_params``, of
    every chunk) / --ddp-num-buckets; without either and with --overlap-grad-reduce, Megatron's default."""
    size = max(rank_params // layout.num_buckets, 1) if layout.num_buckets else layout.bucket_size
    if size is None and layout.overlap_grad_reduce:
        return max(BUCKET_MIN, BUCKET_PER_RANK * n)
    return size


def group_size(layout: Layout, group: str) -> int:
    return layout.dp * layout.cp if group == "dp_cp" else layout.edp


def rank_chunks(model: ModelConfig, layout: Layout, pp_rank: int, par=None) -> list[tuple]:
    """(first layer, layers, pre_process, post_process) of each model chunk of pipeline rank ``pp_rank``;
    ``par``: the parallel config section, for an uneven split (--decoder-first/last-pipeline-num-layers)."""
    first = getattr(par, "decoder_first_pipeline_num_layers", None)
    last = getattr(par, "decoder_last_pipeline_num_layers", None)
    layout_str = getattr(par, "pipeline_model_parallel_layout", None)
    vpp = layout.vpp if layout.vpp > 1 else None
    split = chunk_layers(model.num_layers, layout.pp, vpp, first, last, layout_str)
    out = []
    for v in range(layout.vpp):
        offset, count = split[(v, pp_rank)]
        stage = v * layout.pp + pp_rank
        out.append((offset, count, stage == 0, stage == layout.pp * layout.vpp - 1))
    return out


def chunk_tensors(model: ModelConfig, vocab: int, layout: Layout, chunks: list[tuple], split: Split) -> list[list]:
    kinds = layer_kinds(model)
    return [chunk(model, vocab, split, first, count, pre, post, kinds) for first, count, pre, post in chunks]


def buffers(tensors: list[Tensor], layout: Layout, rank_params: int = 0) -> list[Buffer]:
    """The gradient buffers of one model chunk, in paratron's order (dense, tied, experts); ``rank_params``: the
    rank's parameters in all its chunks (--ddp-num-buckets)."""
    keys: dict = {}
    for t in tensors:
        keys.setdefault((t.group, t.tied), []).append(t)
    out = []
    for (group, tied), ts in sorted(keys.items(), key=lambda kv: (kv[0][0] != "dp_cp", kv[0][1] is not None)):
        n = group_size(layout, group)
        out.append(lay_out(ts, group, n, bucket_size_of(layout, n, rank_params), by_unit=layout.zero >= 3 and n > 1,
                           end_multiple=layout.bucket_end_multiple))
    return out


@dataclass(frozen=True)
class State:
    """Bytes of one rank's model state on the device, and what offload keeps on the host."""
    weights: int
    grads: int
    optimizer: int
    host: int = 0
    params: int = 0  # parameters (elements) of this rank's chunks
    owned: int = 0  # elements this rank's optimizer steps (its shards with ZeRO)
    largest_bucket: int = 0  # elements of the largest gradient bucket


def optimizer_bytes(elems: int, pieces: int, layout: Layout) -> int:
    """fp32 masters (mixed precision), the two moments in their dtypes (--exp-avg-dtype, --exp-avg-sq-dtype) and,
    per tensor stepped, the step counter and the fp32 scale of each fp16 / fp8 moment (optim/moments.py)."""
    per_tensor = STEP_BYTES + 4 * layout.scaled_moments
    return elems * ((4 if layout.mixed else 0) + layout.moment_bytes) + pieces * per_tensor


def buffer_key(layout: Layout) -> tuple:
    """What the gradient buffers' layout reads of a layout besides the parameters (the search's cache key)."""
    return (layout.dp, layout.cp, layout.edp, layout.bucket_size, layout.num_buckets, layout.overlap_grad_reduce,
            layout.zero >= 3, layout.bucket_end_multiple)


def state(chunks_tensors: list[list], layout: Layout, ranks: dict, cache: Optional[dict] = None,
          shape=None) -> State:
    """``ranks``: this rank's index in each gradient group ({"dp_cp": r, "edp": r}; missing: the largest
    shard over the group's ranks, the planner's worst case). ``cache``: the search's, where ``shape`` names the
    parameters ``chunks_tensors`` (their buffers are laid out once per buffer_key)."""
    rank_params = sum(t.numel for tensors in chunks_tensors for t in tensors)
    key = ("buffers", shape, buffer_key(layout))
    if cache is None or key not in cache:
        laid = [buffers(tensors, layout, rank_params) for tensors in chunks_tensors]
        if cache is None:
            return summed(laid, layout, ranks)
        cache[key] = laid
    return summed(cache[key], layout, ranks)


def summed(laid: list[list[Buffer]], layout: Layout, ranks: dict) -> State:
    """The State of a rank's gradient buffers (state)."""
    weights = grads = opt = params = largest = owned = 0
    for chunk_buffers in laid:
        for buf in chunk_buffers:
            params += buf.numel
            largest = max(largest, buf.largest_bucket)
            r = ranks.get(buf.group)
            idx = r if r is not None else max(range(buf.n), key=lambda i: buf.shard_elems[i])
            level = layout.zero if buf.n > 1 else min(layout.zero, 1)  # one rank: nothing more to shard
            if level == 0:
                weights += buf.numel * layout.param_bytes
                grads += buf.total * layout.grad_bytes
                opt += optimizer_bytes(buf.numel, buf.count, layout)
                owned += buf.numel
                continue
            owned += buf.shard_elems[idx]
            opt += optimizer_bytes(buf.shard_elems[idx], buf.shard_pieces[idx], layout)
            weights += (buf.total // buf.n if level >= 3 else buf.total) * layout.param_bytes
            grads += (buf.total // buf.n if level >= 2 else buf.total) * layout.grad_bytes
    moved = int(opt * layout.offload_fraction)
    grads_copy = int(owned * 4 * layout.offload_fraction)  # the fp32 gradients the host's optimizer steps from
    return State(weights, grads, opt - moved, moved + grads_copy, params, largest, owned)

