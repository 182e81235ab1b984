"""FLOPs of a training iteration (Megatron's formula) and the devices' dense peaks: what the run's log line
divides by (paratron/train/metrics.py) and what the planner's time model (paratron/plan/cost.py) divides."""
from __future__ import annotations

from ..config import ModelConfig
from ..config.layer_patterns import parse_moe_layer_freq

# Dense bf16 peak TFLOP/s by device-name fragment (vendor datasheets, SXM parts).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0, "GB200": 2500.0}


def flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int, seq: int) -> float:
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
