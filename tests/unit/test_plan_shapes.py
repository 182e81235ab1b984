"""The planner's parameter list (paratron/plan/shapes.py) is the model's: the same names, in module order, with
the same elements, for the model variants it counts (one rank; tests/parallel/test_plan_state.py checks the
splits over TP, PP, EP on gloo)."""
import pytest
import torch

from paratron.plan.layout import layout_of
from paratron.plan.shapes import Split
from paratron.plan.state import chunk_tensors, rank_chunks
from paratron.train.loop import build_dims, build_model_chunks
from tests.parallel.common import tiny_config

MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
           position_embedding_type="rope")
VARIANTS = [("gpt", {}), ("llama", {}), ("gpt", dict(untie_embeddings_and_output_weights=True)),
            ("llama", dict(qk_layernorm=True, attention_output_gate=True)),
            ("llama", dict(softmax_type="learnable")), ("llama", dict(add_qkv_bias=True)),
            ("gpt", dict(normalization="RMSNorm", squared_relu=True)),
            ("gpt", MLA), ("gpt", dict(q_lora_rank=24, qk_layernorm=True, **MLA)),
            ("llama", dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=48,
                           moe_shared_expert_gate=True)),
            ("gpt", dict(num_experts=4, moe_router_topk=1, moe_layer_freq=2)),
            ("llama", dict(mtp_num_layers=2)), ("llama", dict(mtp_num_layers=2, mtp_use_repeated_layer=True)),
            ("llama", dict(mtp_num_layers=1, num_experts=4, moe_router_topk=2)),
            ("llama", dict(num_experts=4, moe_router_topk=2, moe_latent_size=16, moe_shared_expert_intermediate_size=48)),
            ("gpt", dict(num_experts=4, moe_router_topk=2, moe_latent_size=16))]
# hybrid stacks (docs/hybrid.md): every layer kind of a pattern, Gated DeltaNet in a GPT stack
HYBRID = dict(normalization="RMSNorm", position_embedding_type="none", disable_bias_linear=True,
              mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2, linear_key_head_dim=8,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
VARIANTS += [("gpt", dict(hybrid_layer_pattern="M*G-E", num_experts=4, moe_router_topk=2, **HYBRID)),
             ("gpt", dict(hybrid_layer_pattern="MM-*", squared_relu=True, mamba_num_heads=4, **HYBRID)),
             ("llama", dict(experimental_attention_variant="gated_delta_net", linear_attention_freq="2",
                            num_layers=4, qk_layernorm=True, attention_output_gate=True,
                            **{**HYBRID, "position_embedding_type": "rope"}))]


@pytest.mark.parametrize("style,extra", VARIANTS, ids=[f"{s}-{'-'.join(e) or 'plain'}" for s, e in VARIANTS])
def test_parameter_list_is_the_models(style, extra):
    cfg = tiny_config(style, world_size=1, **extra)
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("meta"))[0]
    layout = layout_of(cfg)
    planned = chunk_tensors(cfg.model, cfg.padded_vocab_size, layout, rank_chunks(cfg.model, layout, 0), Split())[0]
    assert [(t.name, t.numel) for t in planned] == [(n, p.numel()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("extra", [dict(hybrid_layer_pattern="M*G-E", num_experts=4, moe_router_topk=2, **HYBRID),
                                   dict(experimental_attention_variant="gdn", linear_attention_freq="3",
                                        num_layers=6, **HYBRID)])
def test_layer_kinds_and_flops_are_the_models(extra):
    from paratron.model.spec import layer_specs
    from paratron.plan.flops import flops_per_iteration
    from paratron.plan.shapes import layer_kinds
    from paratron.train.host_ops import count_ops, ops_per_layer, tiny_copy
    from paratron.train.step import iteration_flops  # the trainer's log line
    cfg = tiny_config("gpt", world_size=1, **extra)
    assert layer_kinds(cfg.model) == [(s.mixer, s.mlp) for s in layer_specs(cfg.model)]
    m, gb = cfg.model, cfg.train.global_batch_size
    assert iteration_flops(cfg) == flops_per_iteration(m, cfg.padded_vocab_size, gb, m.seq_length)
    attention = sum(s.mixer == "attention" for s in layer_specs(m))  # the s^2 core: attention layers only
    grow = flops_per_iteration(m, 512, 1, 64) - 2 * flops_per_iteration(m, 512, 1, 32)
    assert grow == pytest.approx(6 * m.kv_channels * m.num_attention_heads * attention * (64 ** 2 - 2 * 32 ** 2))
    layer, rest = ops_per_layer(cfg)  # per kind, summed by the pattern: the whole tiny pattern's count
    whole = tiny_copy(cfg, cfg.model.num_layers)
    assert abs(layer * cfg.model.num_layers + rest - count_ops(whole)) <= cfg.model.num_layers
