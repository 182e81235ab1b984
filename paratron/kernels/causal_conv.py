"""The short causal depthwise convolution of Mamba-2 and Gated DeltaNet, in plain torch, with document resets
and a state for generation.

out_t[c] = bias[c] + sum_k weight[c, K-1-k] * x_{t-k}[c] over k = 0..K-1, where an input from before the start
of t's document counts as zero (``reset`` [b, s]: True where a document starts) and inputs before the sequence
come from ``state`` [b, K-1, c] (the last K-1 inputs of the previous call; zeros when None). Returns the output
and the new state: the last K-1 inputs, zeroed where they belong to an earlier document than the last
position's.
"""
from __future__ import annotations

from typing import Optional

import torch


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                reset: Optional[torch.Tensor] = None,
                state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, s, c], weight [c, K] (or nn.Conv1d's [c, 1, K]), bias [c] -> (out [b, s, c], state [b, K-1, c])."""
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
