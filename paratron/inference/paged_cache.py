"""The paged KV cache: one pool of blocks per attention layer, and the view a forward pass of the paged engine
sees it through.

The model-facing interface (what ``SDPAttention.attend`` calls when ``ForwardContext.kv_cache`` is a view with
``paged = True``) is one method::

    out = view.attend(layer_index, q, k, v, scale)   # q [1, heads, n, d], k / v [1, groups, n, d] -> like q

The pass's ``n`` tokens are the new tokens of every request of the step, packed into one sequence (batch 1,
``positions`` as each token's place in its own request). ``attend`` writes their keys and values at
``slots`` (flat pool slots: block * block_size + offset) and returns each token's attention over its own
request's cached tokens up to itself (kernels/paged_attention.py). Multi-latent attention caches one row per
token instead, its normed latent and rotated shared key ``[c ; k_pe]``, and calls ``attend_latent``: absorbed
attention is grouped-query attention with one group whose keys are those rows and whose values are their first
``rank`` entries, so the same kernel serves it (the output's latent part is kept).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..kernels.paged_attention import paged_attention, paged_store
from .cache import RecurrentView


class PagedKVCache(nn.Module):
    """Keys and values of every attention layer in ``num_blocks`` blocks of ``block_size`` tokens:
    ``[num_blocks, block_size, groups on this TP rank, head dim]`` per layer (buffers: fixed addresses)."""

    def __init__(self, model, num_blocks: int, block_size: int, device=None, dtype=None, state_rows: int = 0):
        """``state_rows``: the recurrent states of Mamba-2 / Gated DeltaNet layers, one row per running request
        (their convolution and SSM states are not paged: a request keeps one row of each)."""
        super().__init__()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.latent = model.config.multi_latent_attention
        shape = (num_blocks, block_size, *self.row_shape(model))
        dtype = dtype or next(model.parameters()).dtype
        for i, conv, ssm in _state_shapes(model, state_rows):
            self.register_buffer(f"conv{i}", torch.zeros(conv, device=device, dtype=dtype), persistent=False)
            self.register_buffer(f"ssm{i}", torch.zeros(ssm, device=device), persistent=False)
        for mixer in _mixers(model):
            if not hasattr(mixer, "state_shapes"):
                for name in ("kv",) if self.latent else ("k", "v"):
                    self.register_buffer(f"{name}{mixer.layer_index}", torch.zeros(shape, device=device, dtype=dtype),
                                         persistent=False)

    @staticmethod
    def state_bytes(model, rows: int, dtype: torch.dtype) -> int:
        """Bytes of ``rows`` requests' recurrent states (convolution states in ``dtype``, SSM states in fp32)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(conv) * size + math.prod(ssm) * 4 for _, conv, ssm in _state_shapes(model, rows))

    @staticmethod
    def recurrent(model) -> bool:
        """Whether the model has Mamba-2 / Gated DeltaNet layers (their states are kept per request)."""
        return bool(_state_shapes(model, 0))

    def states(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"conv{index}"), getattr(self, f"ssm{index}")

    @staticmethod
    def row_shape(model) -> tuple[int, int]:
        """What one token keeps per layer: [groups on this TP rank, head dim] of keys (and as much of values), or
        multi-latent attention's one row [1, rank + rope dim] (the latent is the same on every TP rank)."""
        cfg = model.config
        if cfg.multi_latent_attention:
            return 1, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        return cfg.num_query_groups // model.par.tp_size, cfg.kv_channels

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latent:
            pool = getattr(self, f"kv{index}")
            return pool, pool
        return getattr(self, f"k{index}"), getattr(self, f"v{index}")

    @staticmethod
    def block_bytes(model, block_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
        """Bytes of one block over every attention layer (keys and values, or the latent rows) and ``extra_layers``
        pools of a layer's shape (the MTP depths' of speculative decoding)."""
        layers = sum(1 for m in _mixers(model) if not hasattr(m, "state_shapes")) + extra_layers
        groups, width = PagedKVCache.row_shape(model)
        tensors = 1 if model.config.multi_latent_attention else 2
        return tensors * layers * block_size * groups * width * torch.empty((), dtype=dtype).element_size()


def _mixers(model):
    """The token mixer (attention, Mamba-2, Gated DeltaNet) of every decoder layer that has one."""
    return [layer.self_attention for layer in model.decoder.layers if layer.self_attention is not None]


def _state_shapes(model, rows: int) -> list[tuple]:
    """(layer index, convolution state shape, SSM state shape) of each recurrent layer, for ``rows`` requests."""
    return [(m.layer_index, *m.state_shapes(rows)) for m in _mixers(model) if hasattr(m, "state_shapes")]


class StateRows:
    """Which row of the recurrent-state buffers each running request holds: taken at its first pass, given back
    when it finishes; a preempted request's row is taken back when another needs one (it starts afresh anyway)."""

    def __init__(self, rows: int):
        self.free, self.held = list(range(rows)), {}

    def row(self, seq, sched) -> int:
        if seq.id not in self.held:
            if not self.free:
                running = {s.id for s in sched.running}
                for sid in [sid for sid in self.held if sid not in running]:
                    self.free.append(self.held.pop(sid))
            self.held[seq.id] = self.free.pop()
        return self.held[seq.id]

    def release(self, seq) -> None:
        if seq.id in self.held:
            self.free.append(self.held.pop(seq.id))

    def clear(self) -> None:
        self.free += list(self.held.values())
        self.held.clear()


@dataclass
class PagedView:
    """One step's tokens in the pool: ``slots`` [n] where each token's keys / values go, ``tables`` [r, blocks]
    the block table of each request of the step, ``rows`` [n] each token's table row, ``lengths`` [n] how many
    cached tokens each token sees (its position + 1). ``kernel``: the Triton kernel on CUDA (else the torch
    reference). ``tiles`` [n_tiles, 2]: the pass's tokens in tiles of one request's consecutive tokens (prompt
    chunks: kernels/paged_attention.py's tiled form), or None (a token per program)."""
    cache: PagedKVCache
    slots: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor
    kernel: bool = True
    state: Optional["PassStates"] = None  # the recurrent-state rows of the pass (models with recurrent layers)
    tiles: Optional[torch.Tensor] = None
    paged = True

    def recurrent(self, index: int) -> RecurrentView:
        """Layer ``index``'s convolution and SSM states of this pass: the rows of its requests, gathered (fresh
        ones zeroed) and written back by ``update``; one per batch row of a decode pass, or one per document of
        the packed prompt chunks (``cu_seqlens``)."""
        conv, ssm = self.cache.states(index)
        return GatheredStates(conv, ssm, self.state)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, window=None,
               sinks=None) -> torch.Tensor:
        """Store ``k`` / ``v`` [b, groups, s, d] of layer ``index``; q [b, heads, s, d] over the cached tokens
        (``window``: the last window + 1 of them; ``sinks``: a logit per head in every softmax's denominator). The
        pass's b x s tokens are the view's, row by row (one packed row, or one token per row of a batched decode)."""
        ck, cv = self.cache.layer(index)
        groups, d = ck.shape[2], ck.shape[3]
        b, heads, s = q.shape[:3]
        tokens = lambda t: t.permute(0, 2, 1, 3).reshape(b * s, t.size(1), d)  # noqa: E731
        paged_store(ck, self.slots, tokens(k))
        paged_store(cv, self.slots, tokens(v))
        grouped = tokens(q).reshape(b * s, groups, heads // groups, d)
        out = paged_attention(grouped, ck, cv, self.tables, self.rows, self.lengths,
                              scale if scale is not None else d ** -0.5, self.kernel, window, sinks, self.tiles)
        return out.reshape(b, s, heads, d).permute(0, 2, 1, 3)

    def attend_latent(self, index: int, q: torch.Tensor, row: torch.Tensor, scale: float) -> torch.Tensor:
        """Multi-latent attention: store ``row`` [n, rank + pe] (the pass's latents and rotated keys) of layer
        ``index``; ``q`` [n, heads, rank + pe] (queries absorbed into the latent space, and their rotary part)
        over the cached rows -> the attention-weighted rows [n, heads, rank + pe]."""
        pool, _ = self.cache.layer(index)
        paged_store(pool, self.slots, row.view(-1, 1, row.size(-1)))
        return paged_attention(q[:, None], pool, pool, self.tables, self.rows, self.lengths, scale, self.kernel)[:, 0]


@dataclass
class PassStates:
    """The recurrent-state rows of one pass of the paged engine: ``rows`` [r] each request's row; ``fresh`` [r]
    bool (or None) the requests at their first token, whose states start from zero; ``cu_seqlens`` [r + 1] the
    packed pass's document offsets (one document per request, kernels/varlen.py), or None for a decode pass (a
    token per batch row)."""
    rows: torch.Tensor
    fresh: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None


class GatheredStates(RecurrentView):
    """The states of several requests' rows for one pass: read gathered (zeros for fresh requests), written back."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, rows: PassStates):
        gathered = [t.index_select(0, rows.rows) for t in (conv, ssm)]
        if rows.fresh is not None:
            gathered = [t.masked_fill(rows.fresh.view(-1, *[1] * (t.dim() - 1)), 0) for t in gathered]
        super().__init__(*gathered, prefill=False)
        self.pools, self.rows, self.cu_seqlens = (conv, ssm), rows.rows, rows.cu_seqlens

    def update(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.pools[0].index_copy_(0, self.rows, conv.to(self.pools[0].dtype))
        self.pools[1].index_copy_(0, self.rows, ssm.to(self.pools[1].dtype))
