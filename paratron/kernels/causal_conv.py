"""The short causal depthwise convolution of Mamba-2 and Gated DeltaNet, in plain torch, with document resets
and a state for generation.

out_t[c] = bias[c] + sum_k weight[c, K-1-k] * x_{t-k}[c] over k = 0..K-1, where an input from before the start
of t's document counts as zero (``reset`` [b, s]: True where a document starts) and inputs before the sequence
come from ``state`` [b, K-1, c] (the last K-1 inputs of the previous call; zeros when None). Returns the output
and the new state: the last K-1 inputs, zeroed where they belong to an earlier document than the last
position's. ``causal_conv_varlen`` takes packed documents with a state each instead (the paged engine's prompt
chunks of several requests in one pass).
"""
from __future__ import annotations

from typing import Optional

import torch

from .varlen import host_to


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                reset: Optional[torch.Tensor] = None,
                state: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, s, c], weight [c, K] (or nn.Conv1d's [c, 1, K]), bias [c] -> (out [b, s, c], state [b, K-1, c]).
    ``cu_seqlens``: packed documents with a state each (``causal_conv_varlen``; ``reset`` unused)."""
    if cu_seqlens is not None:
        return causal_conv_varlen(x, weight, bias, cu_seqlens, state)
    w = weight.reshape(weight.size(0), -1)
    b, s, c = x.shape
    k = w.size(1)
    past = state if state is not None else x.new_zeros(b, k - 1, c)
    xp = torch.cat([past.to(x.dtype), x], dim=1)  # [b, k-1+s, c]
    seg = None
    if reset is not None:  # the document count of each position; positions before the sequence count 0
        seg = torch.cat([reset.new_zeros(b, k - 1, dtype=torch.long), reset.long().cumsum(1)], dim=1)
    out = x.new_zeros(b, s, c) if bias is None else bias.to(x.dtype).expand(b, s, c)
    for i in range(k):  # tap i reads the input k-1-i positions back
        shifted = xp[:, i:i + s]
        if seg is not None:
            shifted = shifted * (seg[:, i:i + s] == seg[:, k - 1:]).to(x.dtype)[..., None]
        out = out + shifted * w[:, i]
    new_state = xp[:, s:]
    if seg is not None and k > 1:
        new_state = new_state * (seg[:, s:] == seg[:, -1:]).to(x.dtype)[..., None]
    return out, new_state


def causal_conv_varlen(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       cu_seqlens: torch.Tensor,
                       state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution over packed documents (``cu_seqlens`` [d + 1] offsets, as kernels/varlen.py), each
    continuing from its own state: x [1, total, c], state [d, K-1, c] (None: zeros) -> (out [1, total, c], each
    document's new state [d, K-1, c]: the last K-1 inputs of its state followed by its tokens). No tap reads
    another document's input."""
    w = weight.reshape(weight.size(0), -1)
    k, c = w.size(1), x.size(-1)
    cu = host_to(cu_seqlens.to(torch.long), x.device)  # host offsets: no synchronisation
    d, total = cu.numel() - 1, x.size(1)
    doc = torch.repeat_interleave(torch.arange(d, device=x.device), cu.diff(), output_size=total)  # no host read
    past = state if state is not None else x.new_zeros(d, k - 1, c)
    # every document's state then its tokens, one after another: document i's tokens move i + 1 states on
    taps = torch.arange(k - 1, device=x.device)
    at_x = torch.arange(total, device=x.device) + (doc + 1) * (k - 1)
    at_state = (cu[:-1] + torch.arange(d, device=x.device) * (k - 1))[:, None] + taps
    ext = x.new_zeros(total + d * (k - 1), c).index_copy(0, at_x, x[0])
    ext = ext.index_copy(0, at_state.flatten(), past.to(x.dtype).reshape(-1, c))
    out = x.new_zeros(total, c) if bias is None else bias.to(x.dtype).expand(total, c)
    for i in range(k):  # tap i reads the input k-1-i positions back: within the document or its state
        out = out + ext.index_select(0, at_x - (k - 1) + i) * w[:, i]
    ends = cu[1:] + torch.arange(1, d + 1, device=x.device) * (k - 1)  # where each document's run ends
    return out[None], ext.index_select(0, (ends[:, None] - (k - 1) + taps).flatten()).view(d, k - 1, c)
