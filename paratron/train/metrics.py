"""FLOPs per iteration (Megatron's formula), MFU and device facts."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import ModelConfig
from ..plan.flops import PEAK_TFLOPS, mla_attention_terms  # noqa: F401
from ..plan.flops import flops_per_iteration as transformer_flops


def flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
    """FLOPs of forward + backward of one iteration: Megatron's formula (plan/flops.py), or layer by layer for a
    stack with Mamba-2 / Gated DeltaNet layers."""
    if m.hybrid_layer_pattern is not None or m.experimental_attention_variant is not None:
        return hybrid_flops_per_iteration(m, padded_vocab, batch, seq)
    return transformer_flops(m, padded_vocab, batch, seq)


def hybrid_flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
    """FLOPs of forward + backward of one iteration of a stack with Mamba-2 / Gated DeltaNet layers, layer by layer
    (docs/hybrid.md): every matmul 6 x its weights per token; attention's core as in the dense formula; Mamba-2's
    scan 12 x d_inner x state per token (state update and read-out, forward + backward), the gated delta rule's
    18 x value heads x key dim x value dim (read, update, read-out); the convolutions and norms not counted."""
    from ..config.check_hybrid import mamba_heads
    from ..model.spec import layer_specs
    h, V, tokens = m.hidden_size, padded_vocab, batch * seq
    q, kv = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups
    gate = q if m.attention_output_gate else 0
    di, bc = mamba_heads(m) * m.mamba_head_dim, 2 * m.mamba_num_groups * m.mamba_state_dim
    qk, v, nv = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim, \
        m.linear_num_value_heads
    mixer = {"attention": 6 * (h * (q + 2 * kv + gate) + q * h),
             "mamba": 6 * (h * (2 * di + bc + mamba_heads(m)) + di * h) + 12 * di * m.mamba_state_dim,
             "gdn": 6 * (h * (2 * qk + 2 * v + 2 * nv) + v * h)
             + 18 * nv * m.linear_key_head_dim * m.linear_value_head_dim}
    e = 3 if m.swiglu else 2
    routed = (m.moe_ffn_hidden_size or 0) * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0)
    mlp = {"dense": 6 * h * m.ffn_hidden_size * e, "moe": 6 * h * routed * e, None: 0}
    specs = layer_specs(m)
    per_token = sum(mixer.get(s.mixer, 0) + mlp[s.mlp] for s in specs) + 6 * h * V
    attention_layers = sum(s.mixer == "attention" for s in specs)
    return float(tokens * per_token + batch * seq * seq * 6 * q * attention_layers)


def peak_tflops(device: torch.device) -> Optional[float]:
    """Dense bf16 peak of this device, or None when unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_gb(device: torch.device) -> Optional[float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    except Exception:  # pragma: no cover - non-POSIX
        return None
