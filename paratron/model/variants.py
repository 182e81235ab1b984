"""Megatron's MLP activations and the gated attention output, as pure functions of the config.

MLP activations (dense and expert MLPs alike; ``h`` is fc1's output, ``[gate | linear]`` along the
last dimension when the MLP is gated):

* GeLU (default; ``--openai-gelu``: the tanh approximation) and ``--squared-relu``: relu(h)^2;
* gated: ``act(gate) * (linear + --glu-linear-offset)`` with act = SiLU (``--swiglu``),
  quick-GeLU x*sigmoid(1.702x) (``--quick-geglu``, gpt-oss) or GeLU (``--geglu``, T5 v1.1); with ``--activation-func-clamp-value v``
  the gate is first clamped to at most v and the linear half to [-v, v] (gpt-oss's clamps).

Attention output gate (``--attention-output-gate``): the QKV projection has, per query group, the
group's query heads, then as many gate heads, then its key and value heads; the attention output
(before the output projection) is multiplied by sigmoid(gate), computed in fp32.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..fp8 import mlp as fp8_mlp
from ..kernels.swiglu import swiglu, swiglu_reference


def is_gated(cfg: ModelConfig) -> bool:
    """Whether fc1 produces [gate | linear] (twice the FFN width)."""
    return cfg.swiglu or cfg.quick_geglu or cfg.geglu


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


def glu(h: torch.Tensor, act: Callable, offset: float = 0.0, clamp=None) -> torch.Tensor:
    """``act(gate) * (linear + offset)`` of ``h = [gate | linear]``, the halves clamped first when asked."""
    gate, linear = h.chunk(2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
    out = act(gate)
    return out * (linear + offset) if offset else out * linear


def mlp_activation(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation between fc1 and fc2 that ``cfg`` asks for."""
    offset, clamp = cfg.glu_linear_offset, cfg.activation_func_clamp_value
    if cfg.swiglu:
        if offset or clamp is not None:
            return lambda h: glu(h, F.silu, offset, clamp)
        return swiglu_reference if cfg.no_bias_swiglu_fusion else swiglu
    if cfg.quick_geglu:
        return lambda h: glu(h, quick_gelu, offset, clamp)
    approx = "tanh" if cfg.openai_gelu else "none"
    if cfg.geglu:  # T5 v1.1's gated GeLU
        return lambda h: glu(h, lambda g: F.gelu(g, approximate=approx), offset, clamp)
    if cfg.squared_relu:
        return squared_relu
    return lambda h: F.gelu(h, approximate=approx)


def fused_fp8_activation(cfg: ModelConfig) -> Optional[int]:
    """The activation code of ``paratron.fp8.mlp`` for ``cfg``'s MLP, or None where it has no fused FP8
    kernel (quick-GeGLU, squared ReLU, an offset or clamp) or the flags ask for the plain path."""
    if cfg.swiglu:
        plain = cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None or cfg.no_bias_swiglu_fusion
        return None if plain else fp8_mlp.SWIGLU
    if cfg.quick_geglu or cfg.geglu or cfg.squared_relu or cfg.no_bias_gelu_fusion:
        return None
    return fp8_mlp.GELU_TANH if cfg.openai_gelu else fp8_mlp.GELU


def qkv_parts(cfg: ModelConfig) -> int:
    """Head-sized rows per query head of the fused QKV weight: 2 with the output gate (query, gate)."""
    return 2 if cfg.attention_output_gate else 1


def apply_output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``out * sigmoid(gate)``, the sigmoid and product in fp32, returned in ``out``'s dtype (Megatron's)."""
    return (out * torch.sigmoid(gate.float())).to(out.dtype)
