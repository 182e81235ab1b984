"""Maximal-update parameterisation (muP, Megatron's ``--use-mup``): hyperparameters tuned on a narrow
model (``--mup-base-hidden-size``) carry over to a wider one. With width multiplier
m = ``--hidden-size`` / ``--mup-base-hidden-size`` (Megatron's rules, the same flags):

* initialisation: the hidden weight matrices (QKV, fc1, router, experts, MTP projections) draw with
  std ``--init-method-std`` / sqrt(m); the residual-stream projections (attention proj, fc2) with
  ``--init-method-std`` / (sqrt(2 L) sqrt(m)); the embeddings and an untied output layer with the
  embedding std (``--embedding-init-method-std``, default ``--init-method-std``), unscaled;
* forward: the embeddings times ``--mup-embedding-mult``; the logits times ``--mup-output-mult``
  (left at 1.0 it becomes 1/m); attention scores times sqrt(``--mup-base-head-dim``) / d **
  ``--mup-attn-scale-power`` (no base head dim: 1 / d ** power; the default power 1.0 is muP's 1/d);
* Adam: the hidden weight matrices (2-D and more, neither embeddings nor the output layer; Muon's own
  matrices excepted) step with LR (and minimum LR) / m and epsilon / m; the rest with the base values.

``--use-mup`` with m = 1 (no base size) is the base model: the same init and LR as without muP, but
attention at 1/d and the multipliers as given.
"""
from __future__ import annotations

import math
from typing import Optional


def width_mult(cfg) -> float:
    """m of the model section ``cfg`` (1.0 without muP)."""
    return float(cfg.mup_width_mult) if cfg.use_mup else 1.0


def scales_optimizer(cfg) -> bool:
    """Whether muP changes the optimizer: the hidden matrices' LR and eps / m (not at m = 1, as Megatron)."""
    return width_mult(cfg) != 1.0


def hidden_std(cfg) -> float:
    """The init std of the hidden weight matrices."""
    return cfg.init_method_std / math.sqrt(width_mult(cfg))


def output_mult(cfg) -> float:
    """The logits' multiplier (1.0 without muP)."""
    return float(cfg.mup_output_mult) if cfg.use_mup else 1.0


def softmax_scale(cfg, head_dim: int) -> Optional[float]:
    """The attention scores' scale: --softmax-scale when given (T5: 1), muP's under muP, else None (the
    kernels' 1/sqrt(d))."""
    if cfg.softmax_scale is not None:
        return cfg.softmax_scale
    if not cfg.use_mup:
        return None
    base = 1.0 if cfg.mup_base_head_dim is None else math.sqrt(cfg.mup_base_head_dim)
    return base / head_dim ** cfg.mup_attn_scale_power
