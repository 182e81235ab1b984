"""Multi-latent attention (paratron/model/mla.py): logits equal transformers' DeepSeek-V3 with the same
weights, YaRN pieces against hand-computed values, and the flags' one-line errors."""
import math

import pytest
import torch

from paratron.config import ConfigError, ModelConfig
from paratron.model.gpt import GPTModel
from paratron.model.mla import softmax_scale
from paratron.model.yarn import YarnParams, yarn_inv_freq, yarn_mscale

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 96, 32, 4, 2, 24
SHAPE = dict(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)


def paratron_config(q_lora_rank, yarn: bool) -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=40, num_attention_heads=HEADS,
                       seq_length=SEQ, max_position_embeddings=SEQ, position_embedding_type="rope",
                       normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                       multi_latent_attention=True, qk_layernorm=True, q_lora_rank=q_lora_rank,
                       rope_type="yarn" if yarn else "rope", rotary_base=10000.0,
                       **(dict(rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707) if yarn else {}),
                       **SHAPE)


def hf_model(q_lora_rank, yarn: bool):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:  # Megatron's MLA YaRN: original length 4096, betas 32 / 1
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
                           kv_lora_rank=SHAPE["kv_lora_rank"], qk_nope_head_dim=SHAPE["qk_head_dim"],
                           qk_rope_head_dim=SHAPE["qk_pos_emb_head_dim"], v_head_dim=SHAPE["v_head_dim"],
                           first_k_dense_replace=LAYERS, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                           rope_parameters=rope, rope_interleave=True, tie_word_embeddings=False,
                           attention_bias=False, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to ones: random weights test them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def to_paratron(hf: dict, q_lora: bool) -> dict:
    """HF DeepSeek-V3 names -> paratron's (Megatron's); gate/up stacked into fc1."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    attn = {"kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
            "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
    attn.update({"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj"}
                if q_lora else {"q_proj": "linear_q_proj"})
    for i in range(LAYERS):
        h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[p + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for a, b in attn.items():
            out[p + f"self_attention.{b}.weight"] = hf[h + f"self_attn.{a}.weight"]
        out[p + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        out[p + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("q_lora_rank,yarn", [(24, True), (None, True), (24, False)])
def test_logits_equal_transformers_deepseek_v3(q_lora_rank, yarn):
    hf = hf_model(q_lora_rank, yarn)
    model = GPTModel(paratron_config(q_lora_rank, yarn).resolved(), VOCAB).eval()
    model.load_state_dict(to_paratron(hf.state_dict(), q_lora_rank is not None), strict=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


def test_yarn_by_hand():
    assert yarn_mscale(1.0, 0.707) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1.0)
    cfg = ModelConfig(multi_latent_attention=True, qk_head_dim=8, qk_pos_emb_head_dim=4, rotary_scaling_factor=40.0,
                      mscale_all_dim=1.0).resolved()
    assert softmax_scale(cfg) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(12))
    # dim 64, base 10000, original 4096: the ramp runs from dimension pair 10 (floor 10.2) to 23 (ceil 22.1)
    inv = yarn_inv_freq(64, 10000.0, YarnParams(scaling_factor=40.0))
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert torch.allclose(inv[:11], plain[:11]) and torch.allclose(inv[23:], plain[23:] / 40.0)
    w = 1 - (16 - 10) / 13  # pair 16 keeps this much of its original frequency
    assert inv[16].item() == pytest.approx(plain[16].item() / 40.0 * (1 - w) + plain[16].item() * w, rel=1e-6)
    # factor 1: the ordinary frequencies
    assert torch.allclose(yarn_inv_freq(16, 10000.0, YarnParams(scaling_factor=1.0)), 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))


@pytest.mark.parametrize("changes,match", [
    (dict(q_lora_rank=8), "--q-lora-rank has no effect without --multi-latent-attention"),
    (dict(mscale=0.5), "--mscale has no effect without --multi-latent-attention"),
    (dict(rope_type="yarn"), "--rope-type yarn is for multi-latent attention"),
    (dict(multi_latent_attention=True, group_query_attention=True, num_query_groups=2), "exclude each other"),
    (dict(multi_latent_attention=True, qk_pos_emb_head_dim=5), "must be even"),
    (dict(multi_latent_attention=True, rope_type="ntk"), "--rope-type must be rope or yarn"),
    (dict(multi_latent_attention=True, use_rope_scaling=True), "--use-rope-scaling"),
    (dict(multi_latent_attention=True, kv_lora_rank=0), "--kv-lora-rank must be >= 1"),
    (dict(multi_latent_attention=True, rotary_percent=0.5), "--rotary-percent 0.5 applies to"),
])
def test_flag_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**changes).resolved()


def test_flops_by_hand():
    """Megatron's MLA FLOPs formula, written out for h 32, 4 heads, q rank 24, kv rank 16, qk 8 + pe 4, v 6."""
    from paratron.train.metrics import flops_per_iteration
    cfg = paratron_config(24, True).resolved()
    q = 24 * (32 + 4 * 12 + 1)
    kv = 16 * (32 + 4 * (8 + 6) + 1) + 32 * 4
    attention = 6 * (q + kv + 4 * 6 * 32)
    core = 6 * (4 * 12 / 2 + 4 * 6 / 2)
    mlp, logits = 6 * 32 * 40 * 3, 6 * 32 * VOCAB
    b, s = 2, SEQ
    expected = b * s * ((mlp + attention) * LAYERS + logits) + b * s * s * core * LAYERS
    assert flops_per_iteration(cfg, VOCAB, b, s) == pytest.approx(expected, rel=1e-12)


def test_hf_export_needs_deepseek_family_and_the_cache_holds_latents():
    from paratron.checkpoint.hf_config import ConversionError, check_representable
    from paratron.inference.cache import KVCache
    cfg = paratron_config(24, True).resolved()
    with pytest.raises(ConversionError, match="multi-latent attention needs --family deepseek_v3"):
        check_representable(cfg, "llama")
    cache = KVCache(GPTModel(cfg, VOCAB), batch=2, capacity=8)
    assert cache.layer(0)[0].shape == (2, 1, 8, SHAPE["kv_lora_rank"])  # the latent c
    assert cache.layer(0)[1].shape == (2, 1, 8, SHAPE["qk_pos_emb_head_dim"])  # the shared rotary key


def test_fp8_reaches_the_parallel_projections():
    """Under FP8 the column-parallel q/kv up projections and linear_proj run in FP8 (emulated here) and
    stay close to the fp32 model; the replicated down projections keep the weights' dtype."""
    from paratron.fp8 import Recipe
    cfg = paratron_config(24, True)
    torch.manual_seed(0)
    ref = GPTModel(cfg.resolved(), VOCAB).eval()
    fp8 = GPTModel(cfg.resolved(), VOCAB, fp8=Recipe(emulate=True)).eval()
    fp8.load_state_dict(ref.state_dict())
    names = sorted(n.split(".")[-1] for n, m in fp8.named_modules() if getattr(m, "fp8", None) is not None)
    assert names == sorted(["linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"] * 2)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids), fp8(ids)
    assert 0 < (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_checkpoint_config_check_compares_mla_fields():
    from paratron.checkpoint.compat import model_differences
    from paratron.config import Config, finalize

    def config(**model):
        cfg = Config()
        for k, v in dict(multi_latent_attention=True, attention_dropout=0.0, **model).items():
            cfg.set(k, v)
        cfg.data.mock_data, cfg.train.train_iters, cfg.optim.lr = True, 1, 1e-3
        return finalize(cfg, 1)

    saved = config(kv_lora_rank=16).to_dict()
    assert model_differences(saved, config(kv_lora_rank=16)) == []
    assert model_differences(saved, config(kv_lora_rank=8)) == [("kv_lora_rank", 16, 8)]
    assert [d[0] for d in model_differences(saved, config(kv_lora_rank=16, mscale=0.5))] == ["mscale"]
