"""FLOPs of a training iteration (Megatron's formula) and the devices' dense peaks: what the run's log line
divides by (paratron/train/metrics.py) and what the planner's time model (paratron/plan/cost.py) divides."""
from __future__ import annotations

from ..config import ModelConfig
from ..config.check_hybrid import is_hybrid_stack, mamba_heads
from ..config.layer_patterns import parse_moe_layer_freq
from .shapes import layer_kinds

# Dense bf16 peak TFLOP/s by device-name fragment (vendor datasheets, SXM parts).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0, "GB200": 2500.0}


def flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
    """FLOPs of forward + backward of one iteration: Megatron's formula (transformer_flops), or layer by layer for a
    stack with Mamba-2 / Gated DeltaNet layers (hybrid_flops_per_iteration): what the trainer's log line and the
    planner both count."""
    if is_hybrid_stack(m):
        return hybrid_flops_per_iteration(m, padded_vocab, batch, seq)
    return transformer_flops(m, padded_vocab, batch, seq)


def transformer_flops(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
    """FLOPs of forward + backward of one iteration (megatron_facts §5, causal attention as half; BERT's
    bidirectional attention whole, with its LM head's dense layer; the binary head's h x h not counted); MoE
    layers count the top-k experts' and the shared expert's MLPs (Megatron's MoE formula, no router).
    Latent MoE (--moe-latent-size): the experts in the latent width plus the two projections (Megatron's).
    Multi-token prediction (as Megatron's): N more layers of the last layer's kind, each depth's norms
    (3h) and 2h -> h projection, and N more output-layer matmuls."""
    h, f, L, V = m.hidden_size, m.ffn_hidden_size, m.num_layers, padded_vocab
    n_mtp = m.mtp_num_layers or 0
    q = m.kv_channels * m.num_attention_heads
    kv = m.kv_channels * m.num_query_groups
    gate = q if m.attention_output_gate else 0  # the output gate's rows of the QKV projection
    e = 3 if m.swiglu else 2
    tokens = batch * seq
    mlp_width = f * (L + n_mtp)  # summed over layers; an MoE layer counts its active experts (top-k) and shared expert
    latent_proj = 0
    if m.num_experts is not None:
        pattern = parse_moe_layer_freq(m.moe_layer_freq, L)
        moe_layers = sum(pattern) + pattern[-1] * n_mtp  # MTP layers are of the last layer's kind
        routed = m.moe_ffn_hidden_size * m.moe_router_topk * (m.moe_latent_size or h) / h  # latent: in h units
        active = routed + (m.moe_shared_expert_intermediate_size or 0)
        mlp_width = f * (L + n_mtp - moe_layers) + active * moe_layers
        latent_proj = 12 * h * m.moe_latent_size * moe_layers if m.moe_latent_size else 0  # down + up, fwd + bwd
    bert = m.model == "bert"  # bidirectional: the whole score matrix, and the LM head's dense h -> h
    attention, core = 6 * (h * (q + 2 * kv + gate) + q * h), 6 * q * (2 if bert else 1)
    if m.multi_latent_attention:
        attention, core = mla_attention_terms(m)
    L += n_mtp
    per_token = 6 * h * mlp_width * e + latent_proj + attention * L + 6 * n_mtp * (3 * h + 2 * h * h) + 6 * h * V * (n_mtp + 1)
    per_token += 6 * h * h if bert else 0
    return float(tokens * per_token + batch * seq * seq * core * L)


def mla_attention_terms(m: ModelConfig) -> tuple[float, float]:
    """Multi-latent attention's FLOPs per token and layer (projections, norms counted as one
    multiply per element) and the per-token-pair factor of its core (causal as half), as Megatron's."""
    h, n, pe = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    q_head = m.qk_head_dim + pe
    q = h * n * q_head if m.q_lora_rank is None else m.q_lora_rank * (h + n * q_head + 1)
    kv = m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + 1) + h * pe
    return 6 * (q + kv + n * m.v_head_dim * h), 6 * (n * q_head / 2 + n * m.v_head_dim / 2)


def hybrid_flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
    """FLOPs of forward + backward of one iteration of a stack with Mamba-2 / Gated DeltaNet layers, layer by layer
    (docs/hybrid.md): every matmul 6 x its weights per token; attention's core as in the dense formula; Mamba-2's
    scan 12 x d_inner x state per token (state update and read-out, forward + backward), the gated delta rule's
    18 x value heads x key dim x value dim (read, update, read-out); the convolutions and norms not counted."""
    h, V, tokens = m.hidden_size, padded_vocab, batch * seq
    q, kv = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups
    gate = q if m.attention_output_gate else 0
    di, bc = mamba_heads(m) * m.mamba_head_dim, 2 * m.mamba_num_groups * m.mamba_state_dim
    qk, v, nv = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim, \
        m.linear_num_value_heads
    mixer = {"attention": 6 * (h * (q + 2 * kv + gate) + q * h),
             "mamba": 6 * (h * (2 * di + bc + mamba_heads(m)) + di * h) + 12 * di * m.mamba_state_dim,
             "gdn": 6 * (h * (2 * qk + 2 * v + 2 * nv) + v * h)
             + 18 * nv * m.linear_key_head_dim * m.linear_value_head_dim, None: 0}
    e = 3 if m.swiglu else 2
    routed = (m.moe_ffn_hidden_size or 0) * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0)
    mlp = {"dense": 6 * h * m.ffn_hidden_size * e, "moe": 6 * h * routed * e, None: 0}
    kinds = layer_kinds(m)
    per_token = sum(mixer[a] + mlp[f] for a, f in kinds) + 6 * h * V
    return float(tokens * per_token + batch * seq * seq * 6 * q * attention_layers(m))


def attention_layers(m: ModelConfig) -> int:
    """Layers whose mixer is softmax attention (the s^2 core's)."""
    return sum(kind[0] == "attention" for kind in layer_kinds(m))
