"""The model fields of hybrid stacks (Mamba-2 and Gated DeltaNet layers; checked in config/check_hybrid.py),
part of the model section (``ModelConfig`` inherits them: --hybrid-layer-pattern is ``cfg.model.hybrid_layer_pattern``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class HybridFields:
    # hybrid stacks (model/spec.py, docs/hybrid.md): one symbol per layer, M Mamba-2, G Gated DeltaNet, * attention,
    # - MLP, E MoE; "|" marks pipeline stage boundaries
    hybrid_layer_pattern: Optional[str] = None  # e.g. M-M-M*-M-; sets --num-layers to its length
    hybrid_override_pattern: Optional[str] = None  # Megatron's deprecated name of --hybrid-layer-pattern
    hybrid_attention_ratio: float = 0.0  # older Megatron: no pattern, this share of the layers attention (evenly)
    hybrid_mlp_ratio: float = 0.0  # older Megatron: ... and this share MLP layers, the rest Mamba-2
    is_hybrid_model: bool = False  # a hybrid stack (set by a pattern); alone: every layer Mamba-2 (pretrain_hybrid.py)
    spec: Optional[list] = None  # Megatron's "module function" stack spec: its GPT and hybrid/Mamba names accepted
    mamba_state_dim: int = 128  # Mamba-2: SSM state size per head (B and C width per group)
    mamba_head_dim: int = 64  # Mamba-2: channels per head
    mamba_num_groups: int = 8  # Mamba-2: B / C groups (heads share them; TP splits whole groups)
    mamba_num_heads: Optional[int] = None  # Mamba-2: heads (default 2 * hidden / --mamba-head-dim)
    mamba_dt_limit_min: float = 0.0  # Mamba-2: dt clamped from below (Megatron 0; Hugging Face time_step_limit[0])
    mamba_chunk_size: int = 128  # Mamba-2 / Gated DeltaNet: the chunked scan's chunk length (Megatron's fixed 128)
    experimental_attention_variant: Optional[str] = None  # gated_delta_net | gdn: Gated DeltaNet in the GPT stack
    linear_attention_freq: Optional[str] = None  # int N (every Nth layer attention, the rest GDN) or a 0/1 list (1 GDN)
    linear_conv_kernel_dim: int = 4  # Gated DeltaNet: short convolution width
    linear_key_head_dim: int = 128  # Gated DeltaNet: query / key head size
    linear_value_head_dim: int = 128  # Gated DeltaNet: value head size
    linear_num_key_heads: int = 16  # Gated DeltaNet: query / key heads
    linear_num_value_heads: int = 32  # Gated DeltaNet: value heads (a multiple of the key heads)
