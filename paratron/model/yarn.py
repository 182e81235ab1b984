"""YaRN rotary embedding (Peng et al., 2023, arXiv:2309.00071) with Megatron-core's numbers.

Two things change against plain RoPE:

* the inverse frequencies: the fast-rotating dimensions keep RoPE's frequency (extrapolation), the
  slow ones are divided by ``scaling_factor`` (interpolation), and a linear ramp blends the two over
  the dimensions whose number of rotations within ``original_max_position_embeddings`` positions
  lies between ``beta_slow`` and ``beta_fast`` (:func:`yarn_inv_freq`);
* the "concentration" (attention) factor: cos and sin are multiplied by it, so every q.k logit is
  scaled by its square (:func:`yarn_concentration_factor`, Megatron's ``mscale`` / ``mscale_all_dim``).

Megatron's defaults (megatron/training/argument_utils.py, for ``--position-embedding-type yarn``):
scaling factor 1.0, original positions 4096, beta fast 32, beta slow 1, mscale 1.0, mscale_all_dim
0.0, correction range rounded to integers. Pure functions of numbers: the multi-latent attention
path can call them with its own dimensions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnParams:
    """YaRN's knobs (Megatron flag in brackets)."""
    scaling_factor: float = 1.0  # --rotary-scaling-factor
    original_max_position_embeddings: int = 4096  # --yarn-original-max-position-embeddings
    beta_fast: float = 32.0  # --yarn-beta-fast
    beta_slow: float = 1.0  # --yarn-beta-slow
    mscale: float = 1.0  # --mscale
    mscale_all_dim: float = 0.0  # --mscale-all-dim
    round_to_int: bool = True  # --yarn-correction-range-round-to-int / --no-...


def correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The (fractional) dimension pair index whose frequency turns ``rotations`` times over
    ``max_positions`` positions (RoPE's frequency formula solved for the index)."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def correction_range(dim: int, base: float, p: YarnParams) -> tuple[float, float]:
    """[low, high] pair indices of the ramp, clamped to [0, dim - 1] (floor/ceil when rounding)."""
    low = correction_dim(p.beta_fast, dim, base, p.original_max_position_embeddings)
    high = correction_dim(p.beta_slow, dim, base, p.original_max_position_embeddings)
    if p.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, p: YarnParams) -> torch.Tensor:
    """Inverse frequencies [dim // 2] (fp32, CPU) of YaRN for a rotary dimension ``dim``."""
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    interpolated = extrapolated / p.scaling_factor
    low, high = correction_range(dim, base, p)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: RoPE's own frequency, 0: interpolated
    return interpolated * (1 - keep) + extrapolated * keep


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(p: YarnParams) -> float:
    """The factor cos and sin are multiplied by (Megatron: ``_yarn_get_concentration_factor``)."""
    return float(_mscale(p.scaling_factor, p.mscale) / _mscale(p.scaling_factor, p.mscale_all_dim))


def yarn_params(cfg) -> YarnParams:
    """The YaRN knobs of a ModelConfig, Megatron's defaults where a flag is unset."""
    d = YarnParams()
    return YarnParams(
        scaling_factor=cfg.rotary_scaling_factor,
        original_max_position_embeddings=(cfg.yarn_original_max_position_embeddings
                                          or d.original_max_position_embeddings),
        beta_fast=d.beta_fast if cfg.yarn_beta_fast is None else cfg.yarn_beta_fast,
        beta_slow=d.beta_slow if cfg.yarn_beta_slow is None else cfg.yarn_beta_slow,
        mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim,
        round_to_int=cfg.yarn_correction_range_round_to_int)
