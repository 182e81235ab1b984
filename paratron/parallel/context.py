"""Context parallelism: the sequence of every sample split over the ``--context-parallel-size`` ranks
of a CP group, and attention across the split.

Layout (Megatron's load balancing): the sequence is cut into 2 x CP chunks of s / (2 CP) tokens and
CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``, in that order. Under causal attention chunk i
attends to i + 1 chunks, so every rank has the same work (chunk r's r + 1 plus chunk 2CP-1-r's 2CP - r).
The split happens in the data path (``BatchLayout.prepare``): tokens, labels, loss mask and position
ids are sliced with ``split_sequence``, so the whole model (embedding, norms, MLP, output layer and
loss) only ever sees this rank's 2 chunks; only attention looks across ranks:

- ``p2p`` (default, ring.py): ring attention, K/V blocks passed around the CP ring;
- ``a2a`` (Ulysses): an all-to-all turns [all heads, s/CP tokens] into [heads/CP, all s tokens],
  attention runs on the whole sequence, a second all-to-all turns it back; heads (per TP rank) must
  divide by CP;
- ``allgather`` (ring.py): the ring's block pairs and kernels, with every rank's K/V from one
  all-gather instead of CP - 1 ring steps, and the K/V gradients home by one reduce-scatter: fewer,
  larger messages (nothing to overlap them with), K/V of the whole sequence in memory while a layer's
  attention runs;
- ``a2a+p2p`` with ``--hierarchical-context-parallel-sizes A P`` (A x P = CP): Ulysses within each
  group of A consecutive CP ranks (``cp_a2a``), then the ring over the P ranks that hold the same place
  in their groups (``cp_p2p``). After the all-to-all a rank of ring position j holds, for its H/A heads,
  the chunks j A .. j A + A - 1 and their mirror images: exactly the ring's two-chunk layout for P ranks
  with chunks A times longer, so the ring runs unchanged on them.

The recurrent mixers of hybrid stacks (Mamba-2, Gated DeltaNet) need every token of a sequence in order:
``channels_to_sequence`` turns [this rank's 2 chunks, all of a TP rank's heads] into [the whole sequence, 1/CP
of them] by one all-to-all (the chunks put back in natural order), ``sequence_to_channels`` undoes it, and
``share_rows`` slices the per-head parameters of a rank's share.

Gradients of the (replicated) weights are reduced over the data-and-context-parallel group; the
loss of a micro-batch is normalised by its token count over the whole CP group (``BatchLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..config.values import COMM_TYPES
from . import comm
from .comm import all_to_all
from .ring import Ring, allgather_attention, chunk_positions, ring_attention



# ---- the sequence split ----------------------------------------------------------------------------
def split_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Chunks ``rank`` and ``2 cp - 1 - rank`` of the 2 cp chunks of ``t`` along ``dim``."""
    if cp == 1:
        return t
    if t.size(dim) % (2 * cp):
        raise ValueError(f"sequence length {t.size(dim)} is not divisible by 2 x context-parallel size {cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def merge_sequence(parts: list, dim: int = 1) -> torch.Tensor:
    """The inverse of ``split_sequence``: the whole sequence from every rank's part, in rank order."""
    cp = len(parts)
    chunks = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def natural_order(cp: int) -> list:
    """Index, in the rank-ordered list of chunks (rank 0's two, rank 1's two, ...), of each chunk of
    the sequence in order."""
    return [2 * k if k < cp else 2 * (2 * cp - 1 - k) + 1 for k in range(2 * cp)]


# ---- Ulysses (a2a) -----------------------------------------------------------------------------
def _heads_to_sequence(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, h, 2c, d] (all heads, this rank's 2 chunks) -> [b, h/CP, 2 CP c, d] (h/CP heads, the
    whole sequence in order)."""
    b, h, s2, d = x.shape
    parts = all_to_all(x.reshape(b, cp, h // cp, s2, d).transpose(0, 1), group)  # [CP src, b, h/CP, 2c, d]
    chunks = parts.reshape(cp, b, h // cp, 2, s2 // 2, d).permute(0, 3, 1, 2, 4, 5).reshape(2 * cp, b, h // cp,
                                                                                              s2 // 2, d)
    order = torch.tensor(natural_order(cp), device=x.device)
    return chunks.index_select(0, order).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s2, d)


def _sequence_to_heads(y: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of ``_heads_to_sequence``."""
    b, hc, s, d = y.shape
    c = s // (2 * cp)
    chunks = y.reshape(b, hc, 2 * cp, c, d).permute(2, 0, 1, 3, 4)  # [2CP in order, b, hc, c, d]
    inverse = torch.empty(2 * cp, dtype=torch.long)
    inverse[torch.tensor(natural_order(cp))] = torch.arange(2 * cp)
    per_rank = chunks.index_select(0, inverse.to(y.device)).reshape(cp, 2, b, hc, c, d)
    per_rank = per_rank.permute(0, 2, 3, 1, 4, 5).reshape(cp, b, hc, 2 * c, d)
    back = all_to_all(per_rank, group)  # [CP (head part), b, hc, 2c, d]
    return back.transpose(0, 1).reshape(b, cp * hc, 2 * c, d)


# ---- channel-split mixers (Mamba-2, Gated DeltaNet) ----------------------------------------------------
def channels_to_sequence(parts: list, cp: int, group) -> list:
    """Each of ``parts`` [b, 2c, n_i] (this rank's tokens; n_i channels as ``cp`` equal contiguous shares, whole
    heads each) -> [b, s, n_i / cp]: this rank's share of the channels at every token of the whole sequence, in
    order (the load-balancing permutation undone). One all-to-all carries all the parts."""
    b, s2 = parts[0].shape[:2]
    sizes = [t.size(-1) // cp for t in parts]
    packed = torch.cat([t.reshape(b, s2, cp, n) for t, n in zip(parts, sizes)], dim=-1)  # [b, 2c, cp, sum]
    whole = _heads_to_sequence(packed.transpose(1, 2), cp, group)  # [b, 1, s, sum]: share = "head" group
    return list(whole[:, 0].split(sizes, dim=-1))


def sequence_to_channels(y: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of ``channels_to_sequence`` for one part: [b, s, n / cp] -> [b, 2c, n] (this rank's tokens in
    the load-balanced order, every share of the channels)."""
    b, s, n = y.shape
    back = _sequence_to_heads(y.unsqueeze(1), cp, group)  # [b, cp, 2c, n]
    return back.transpose(1, 2).reshape(b, s // cp, cp * n)


def share_rows(t: torch.Tensor, blocks: tuple, cp: int, rank: int) -> torch.Tensor:
    """Share ``rank`` of ``cp`` of each block of ``t``'s rows (``blocks``: their sizes, in order), concatenated:
    slices of ``t``, so the gradient lands in this rank's rows of ``t``."""
    out, start = [], 0
    for size in blocks:
        share = size // cp
        out.append(t.narrow(0, start + rank * share, share))
        start += size
    return torch.cat(out) if len(out) > 1 else out[0]


def document_causal_mask(docs: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True = may attend: causal within each document of ``docs`` [b, s]."""
    s = docs.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=docs.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)


def _to_sequence(q, k, v, cp: int, group):
    """The first all-to-all of q, k, v (K/V heads repeated to the query heads first when the groups do
    not divide by ``cp``)."""
    h, g = q.size(1), k.size(1)
    if g % cp:
        k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    return tuple(_heads_to_sequence(t, cp, group) for t in (q, k, v))


PAD = 8  # extra head dimensions carrying the sink score (a multiple of 8 keeps SDPA's fast kernels)


def with_sink_dims(q, k, v, sink, scale):
    """q, k, v with ``PAD`` more dimensions and a sink key (zero value) first along the keys: keys get
    zeros there, the sink key a 1 in the first, and each query head carries ``sink / scale``, so its
    score with the sink key is exactly its sink logit (grouped heads share keys: the per-head value
    sits on the query side)."""
    b, h, sq, _ = q.shape
    g, sk = k.size(1), k.size(2)
    q_extra = (sink.to(torch.promote_types(q.dtype, torch.float32)) / scale).to(q.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    q = torch.cat([q, q_extra, q.new_zeros(b, h, sq, PAD - 1)], dim=-1)
    k = torch.cat([k, k.new_zeros(b, g, sk, PAD)], dim=-1)
    v = torch.cat([v, v.new_zeros(b, g, sk, PAD)], dim=-1)
    sink_key = k.new_zeros(b, g, 1, k.size(-1))
    sink_key[..., k.size(-1) - PAD] = 1.0
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v.new_zeros(b, g, 1, v.size(-1)), v], dim=2)
    return q, k, v


def whole_sequence_attention(q, k, v, docs=None, scale: Optional[float] = None, window=None, sink=None):
    """Causal (document-causal with ``docs``) attention of whole sequences q [b, h, s, d], k/v
    [b, g, s, d], with a sliding ``window`` (left, right) and per-head ``sink`` logits when given (then
    as one boolean [s, s] mask: memory grows with the square of the sequence)."""
    h, g, d = q.size(1), k.size(1), q.size(-1)
    scale = d ** -0.5 if scale is None else scale
    if window is None and sink is None:
        mask = document_causal_mask(docs) if docs is not None else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=g != h,
                                              scale=scale)
    pos = torch.arange(q.size(2), device=q.device)
    allowed = document_causal_mask(docs) if docs is not None else (pos[None, :] <= pos[:, None])[None, None]
    if window is not None:
        allowed = allowed & (pos[None, :] >= pos[:, None] - window[0])
    if sink is not None:
        q, k, v = with_sink_dims(q, k, v, sink, scale)
        allowed = torch.cat([allowed.new_ones(allowed.shape[:-1] + (1,)), allowed], dim=-1)
    if g != h and q.is_cuda:  # SDPA's masked CUDA kernel takes no grouped heads
        k, v = (t.repeat_interleave(h // g, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.size(1) != h)
    return out[..., :d]


def _local_heads(sink: Optional[torch.Tensor], group) -> Optional[torch.Tensor]:
    """The sink logits of the heads this rank holds after the first all-to-all over ``group``."""
    if sink is None:
        return None
    n, i = sink.numel() // comm.group_size(group), comm.group_rank(group)
    return sink[i * n:(i + 1) * n]


def ulysses_attention(q, k, v, cp: int, group, docs: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                      window=None, sink: Optional[torch.Tensor] = None):
    """q [b, h, 2c, d], k/v [b, g, 2c, d]: attention over the whole sequence through two all-to-alls.
    ``scale``: of the scores (None: 1/sqrt(d)); ``window``, ``sink``: as ``whole_sequence_attention``."""
    q, k, v = _to_sequence(q, k, v, cp, group)
    out = whole_sequence_attention(q, k, v, docs, scale, window, _local_heads(sink, group))
    return _sequence_to_heads(out, cp, group)


def _ring(dims, name: str) -> Ring:
    """This rank's ring over its group ``name`` (global ranks of the neighbours)."""
    ranks = dims.group_ranks[name]
    i, n = ranks.index(dims.rank), len(ranks)
    return Ring(dims.group(name), i, n, ranks[(i + 1) % n], ranks[(i - 1) % n])


# ---- what the model holds --------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group and how attention crosses it (``ForwardContext.cp``)."""
    group: object
    size: int
    rank: int
    comm_type: str = "p2p"  # one type for every layer, or Megatron's per-layer list as its words
    ring: Optional[Ring] = None  # the ring over the whole CP group (p2p, allgather)
    kernel: Optional[str] = None  # the ring's block kernel (ring.KERNELS); None: chosen per device and dtype
    inner: Optional[tuple] = None  # a2a+p2p: (group, size) of the cp_a2a level
    outer: Optional[Ring] = None  # a2a+p2p: the ring of the cp_p2p level

    @classmethod
    def from_dims(cls, dims, comm_type: str = "p2p") -> Optional["ContextParallel"]:
        """None at CP 1. ``comm_type``: one of COMM_TYPES, or one per layer separated by spaces."""
        if dims.cp == 1:
            return None
        kinds = set(comm_type.split())
        if not kinds or not kinds <= set(COMM_TYPES):
            raise ValueError(f"--cp-comm-type {comm_type}: each type must be one of {', '.join(COMM_TYPES)}")
        inner = outer = None
        if "a2a+p2p" in kinds:
            if "cp_a2a" not in dims.group_ranks:
                raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
            inner, outer = (dims.group("cp_a2a"), dims.size("cp_a2a")), _ring(dims, "cp_p2p")
        ring = _ring(dims, "cp") if kinds & {"p2p", "allgather"} else None
        return cls(dims.cp_group, dims.cp, dims.cp_rank, comm_type, ring, inner=inner, outer=outer)

    def kind(self, layer: Optional[int] = None) -> str:
        """The comm type of layer ``layer`` (0-based; layers past the list, such as MTP's, take the last
        layer's type)."""
        kinds = self.comm_type.split()
        return kinds[0] if layer is None or len(kinds) == 1 else kinds[min(layer, len(kinds) - 1)]

    def attention(self, q, k, v, docs: Optional[torch.Tensor] = None, scale: Optional[float] = None, window=None,
                  sink: Optional[torch.Tensor] = None, layer: Optional[int] = None) -> torch.Tensor:
        """Causal (document-causal with ``docs``, the whole sequence's ids [b, s]) attention of this
        rank's queries q [b, h, 2c, d] over the whole sequence; k/v [b, g, 2c, d] are this rank's.
        ``scale``: of the scores (None: 1/sqrt(d)); ``window`` (left, right): a sliding window; ``sink``
        [h]: attention-sink logits (--softmax-type); ``layer``: whose comm type (a per-layer list)."""
        kind = self.kind(layer)
        if kind == "a2a":
            return ulysses_attention(q, k, v, self.size, self.group, docs, scale, window, sink)
        if kind == "allgather":
            return allgather_attention(q, k, v, self.ring, docs, scale, self.kernel, window, sink)
        if kind == "a2a+p2p":
            group, size = self.inner
            q, k, v = _to_sequence(q, k, v, size, group)
            out = ring_attention(q, k, v, self.outer, docs, scale, self.kernel, window, _local_heads(sink, group))
            return _sequence_to_heads(out, size, group)
        return ring_attention(q, k, v, self.ring, docs, scale, self.kernel, window, sink)

    def positions(self, seq_length: int, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens."""
        return chunk_positions(self.rank, self.size, seq_length // (2 * self.size), device)
