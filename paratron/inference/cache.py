"""The inference KV cache: keys and values of every attention layer, pre-allocated for one batch.

Shapes are static: ``[batch, heads, capacity, width]`` per layer and tensor, as the layer's ``cache_dims()``
says: grouped-query attention caches keys and values of its ``num_query_groups`` heads on this TP rank (not the
query heads); multi-latent attention caches its compressed latent ``c`` (``--kv-lora-rank`` wide) and its
rotated shared key (``--qk-pos-emb-head-dim``), one 'head' each, in the ``k`` and ``v`` tensors. Prompts are
left-padded, so all rows of the batch write the same cache slot at each step and a decode step has the same shapes
every time (what CUDA graphs and ``torch.compile`` want). Row ``i`` holds ``pad[i]`` padding slots
first; the token in slot ``j`` has position ``j - pad[i]``.

A forward pass sees the cache through a :class:`CacheView`: the slots it writes (a tensor, so a
decode step's slot is data, not a shape) and how many slots it attends over.

Mamba-2 and Gated DeltaNet layers keep no keys and values: their cache is the recurrent state (fp32) and the
last inputs of their short convolution, one of each per row (:class:`RecurrentView`). A prefill starts them
from zero, with a document start at each row's first real token, so the left padding never enters them.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values for ``batch`` rows of up to ``capacity`` tokens. The tensors are buffers (fixed
    addresses: a captured CUDA graph reads and writes them in place)."""

    def __init__(self, model, batch: int, capacity: int, device=None, dtype=None, mtp_depths: int = 0):
        """``mtp_depths``: also a cache for each of the first N multi-token prediction depths (speculative
        decoding drafts with them: speculative.py), keyed ``num_layers + k`` for depth k + 1."""
        super().__init__()
        dtype = dtype or next(model.parameters()).dtype
        self.batch, self.capacity = batch, capacity
        widest = 1  # most key / value heads of a layer
        for index, mixer in attention_layers(model, mtp_depths):
            if hasattr(mixer, "state_shapes"):  # a recurrent layer: conv and SSM states
                conv, ssm = mixer.state_shapes(batch)
                self.register_buffer(f"conv{index}", torch.zeros(conv, device=device, dtype=dtype), persistent=False)
                self.register_buffer(f"ssm{index}", torch.zeros(ssm, device=device), persistent=False)
                continue
            for name, (heads, width) in zip("kv", mixer.cache_dims()):
                widest = max(widest, heads)
                buffer = torch.zeros(batch, heads, capacity, width, device=device, dtype=dtype)
                self.register_buffer(f"{name}{index}", buffer, persistent=False)
        # pad[i]: padding slots at the start of row i (left padding)
        self.register_buffer("pad", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        # one counter per key / value head for the fused decode attention's splits (kernels/decode_rotary.py: each
        # layer's kernel counts its splits in and leaves them 0 again)
        self.register_buffer("counts", torch.zeros(widest, dtype=torch.int32, device=device), persistent=False)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{index}"), getattr(self, f"v{index}")

    def states(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(convolution state, SSM state) of the recurrent layer ``index``."""
        return getattr(self, f"conv{index}"), getattr(self, f"ssm{index}")

    def prefill_mask(self, length: int) -> torch.Tensor:
        """[b, 1, length, length]: causal, padding keys hidden (a padding query sees itself only, so no
        row of the softmax is empty)."""
        slots = torch.arange(length, device=self.pad.device)
        causal = slots[None, :] <= slots[:, None]
        real_key = slots[None, None, :] >= self.pad[:, None, None]
        own = slots[None, :] == slots[:, None]
        return ((causal[None] & real_key) | own[None])[:, None]

    def decode_mask(self, slot: torch.Tensor) -> torch.Tensor:
        """[b, 1, 1, capacity]: the real slots up to ``slot`` (a 0-d tensor) of each row."""
        slots = torch.arange(self.capacity, device=self.pad.device)
        return ((slots[None, :] >= self.pad[:, None]) & (slots[None, :] <= slot))[:, None, None, :]

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        """[b, len(slots)] position ids of the tokens in ``slots`` (0 for padding)."""
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)


def attention_layers(model, mtp_depths: int = 0):
    """(cache key, attention module) of every layer that caches: the decoder's, then the first ``mtp_depths``
    multi-token prediction depths (one key per depth, also when --mtp-use-repeated-layer shares one layer)."""
    for layer in model.decoder.layers:
        if layer.self_attention is not None:
            yield layer.self_attention.layer_index, layer.self_attention
    if mtp_depths:
        layers = model.mtp.layers
        for k in range(mtp_depths):
            yield model.config.num_layers + k, layers[k % len(layers)].mtp_model_layer.self_attention


class CacheView:
    """What one forward pass does with the cache: write slots ``slots`` (1-d tensor, consecutive) and
    attend over the first ``length`` slots."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, length: int):
        self.cache, self.slots, self.length = cache, slots, length

    def _buffers(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layer(index)

    def buffers(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers this pass writes of layer ``index`` (a fused kernel writes them itself)."""
        return self._buffers(index)

    def recurrent(self, index: int) -> "RecurrentView":
        """The states of the Mamba-2 / DeltaNet layer ``index`` for this pass: a prefill (the pass writes the slots
        from 0 on) starts from zero with a document start at each row's first real token."""
        conv, ssm = self.cache.states(index)
        n = self.slots.numel()
        if self.length != n:  # decoding: go on from the states
            return RecurrentView(conv, ssm, prefill=False)
        pad = self.cache.pad[:, None]
        reset = (torch.arange(n, device=pad.device)[None, :] == pad) & (pad > 0)
        return RecurrentView(conv, ssm, prefill=True, reset=reset)

    def counts(self) -> torch.Tensor:
        """int32 zeros, one per key / value head, kept between passes (the fused decode attention's)."""
        return self.cache.counts

    def bounds(self):
        """(pad [b], slot: 0-d) for a pass of one token per row: each row attends over its slots pad[row] ..
        slot (what ``KVCache.decode_mask`` allows); None where a mask of its own decides."""
        return self.cache.pad, self.slots[-1]

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ([b, groups, s, d]) of layer ``index``; return the keys and values to attend over."""
        ck, cv = self._buffers(index)
        ck.index_copy_(2, self.slots, k.to(ck.dtype))
        cv.index_copy_(2, self.slots, v.to(cv.dtype))
        return ck[:, :, :self.length], cv[:, :, :self.length]


class RowView(CacheView):
    """A pass over one row ``row`` of the cache (a prompt joining a running batch: continuous.py):
    writes its slots of that row only and attends over that row's first ``length`` slots."""

    def __init__(self, cache: KVCache, row: int, slots: torch.Tensor, length: int):
        super().__init__(cache, slots, length)
        self.row = row

    def _buffers(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t[self.row:self.row + 1] for t in self.cache.layer(index))  # views: written in place

    def bounds(self):
        return None  # its pass's mask (Engine.prefill_row) decides

    def recurrent(self, index: int) -> "RecurrentView":
        """A new prompt in this row: its states start from zero (views of the row: written in place)."""
        conv, ssm = (t[self.row:self.row + 1] for t in self.cache.states(index))
        return RecurrentView(conv, ssm, prefill=True)


class RecurrentView:
    """A recurrent layer's states in one pass: ``conv`` and ``ssm`` to start from (None in a prefill: zeros),
    ``reset`` [b, s] the document starts of a prefill (None: none), ``update`` stores the pass's final states.
    ``cu_seqlens`` (the paged engine's packed prompt chunks, paged_cache.py ``GatheredStates``): the pass is one
    row of several requests' tokens, ``conv`` / ``ssm`` hold a state per request (kernels/varlen.py)."""

    cu_seqlens = None

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, prefill: bool, reset=None):
        self._conv, self._ssm, self.prefill, self.reset = conv, ssm, prefill, reset

    @property
    def conv(self):
        return None if self.prefill else self._conv

    @property
    def ssm(self):
        return None if self.prefill else self._ssm

    def update(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self._conv.copy_(conv)
        self._ssm.copy_(ssm)
