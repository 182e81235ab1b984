"""Rotary position embedding: the frequencies (Llama-3.1 scaling, YaRN), the cos / sin tables, the
interleaved form; the rotation itself is kernels/rotary.py's ``apply_rotary``."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.rotary import apply_rotary
from .yarn import yarn_concentration_factor, yarn_inv_freq, yarn_params


def rope_inv_freq(dim: int, base: float, scaling: bool = False, factor: float = 8.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_positions: int = 8192) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3.1's long-context scaling when asked."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form, as Llama/GPT-NeoX), cos/sin cached. With
    ``--position-embedding-type yarn``: YaRN's frequencies, cos and sin times its attention factor
    (Megatron applies that factor to q's and k's rotation alike)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        # Computed on the CPU (the same numbers whatever the device), or not at all for a meta model.
        where = "meta" if torch.device(device or "cpu").type == "meta" else "cpu"
        factor = 1.0
        if cfg.position_embedding_type == "yarn":  # the whole head (validation refuses --rotary-percent)
            self.dim, params = cfg.kv_channels, yarn_params(cfg)
            inv = yarn_inv_freq(self.dim, cfg.rotary_base, params).to(where)
            factor = yarn_concentration_factor(params)
        else:
            self.dim = int(cfg.kv_channels * cfg.rotary_percent)
            inv = rope_inv_freq(self.dim, cfg.rotary_base, cfg.use_rope_scaling, cfg.rope_scaling_factor).to(where)
        pos = torch.arange(max(cfg.max_position_embeddings, cfg.seq_length), dtype=torch.float32, device=where)
        if cfg.rotary_seq_len_interpolation_factor:  # position interpolation: positions squeezed by the factor
            pos = pos / cfg.rotary_seq_len_interpolation_factor
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * factor).to(device), persistent=False)

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor]):
        """cos, sin shaped to broadcast over [s, b, heads, dim]."""
        if position_ids is None:
            return self.cos[:seq_len, None, None, :], self.sin[:seq_len, None, None, :]
        return (self.cos[position_ids].transpose(0, 1)[:, :, None, :],
                self.sin[position_ids].transpose(0, 1)[:, :, None, :])


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary with the rotated dimensions in interleaved pairs (RoFormer's, ``--rotary-interleaved``;
    DeepSeek's MLA weights): reordered even-then-odd, then the rotate-half rotation. Applied to queries
    and keys alike, the reordering does not change q . k, so attention equals the interleaved form's."""
    d = cos.size(-1)
    pairs, rest = x.split([d, x.size(-1) - d], dim=-1)  # (split and unbind: the backward writes x's gradient once)
    rot = torch.cat(pairs.unflatten(-1, (d // 2, 2)).unbind(-1), dim=-1)
    return apply_rotary(rot if d == x.size(-1) else torch.cat([rot, rest], dim=-1), cos, sin)
