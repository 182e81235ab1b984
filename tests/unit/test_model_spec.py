"""Per-layer specs (Megatron's --moe-layer-freq and --hybrid-override-pattern shapes), the layer
factory, the forward context, and the shape-only (meta device) model."""
import pytest
import torch

from paratron.config import ConfigError, ModelConfig
from paratron.model.gpt import GPTModel
from paratron.model.layers import Attention, ForwardContext, Parallel
from paratron.model.spec import LayerSpec, layer_specs, parse_hybrid_override_pattern, parse_moe_layer_freq
from paratron.model.transformer import TransformerLayer


def tiny(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base).resolved()


@pytest.mark.parametrize("value,n,want", [
    (1, 3, [1, 1, 1]),
    (2, 5, [1, 0, 1, 0, 1]),  # Megatron: layer i is MoE when i % k == 0
    ("3", 6, [1, 0, 0, 1, 0, 0]),
    ([0, 1, 1], 3, [0, 1, 1]),
    ("[0,1, 1]", 3, [0, 1, 1]),
    ("([0]*1+[1]*3)*4", 16, [0, 1, 1, 1] * 4),
    ("[0]+[1]*23", 24, [0] + [1] * 23),
    ("2*([1]+[0])", 4, [1, 0, 1, 0]),
    ("[1]*(2*2)", 4, [1, 1, 1, 1]),
])
def test_moe_layer_freq(value, n, want):
    assert parse_moe_layer_freq(value, n) == want


@pytest.mark.parametrize("value,match", [
    (0, ">= 1"),
    ("[1,0]", "2 entries, --num-layers is 3"),
    ([1, 2, 0], "0 \\(dense\\) or 1"),
    ([True, False, True], "0 \\(dense\\) or 1"),
    ("[1]*2 + [0.5]", "only int and list literals"),
    ("__import__('os').system('false')", "only int and list literals"),
    ("[1]*10**12", "only int and list literals"),
    ("[1]*1000000000000", "more entries than the 3 layers"),
    ("[1]*2+[0]*2", "more entries than the 3 layers"),
    ("(1, 0, 1)", "only int and list literals"),
    ("[1]*[1]", "cannot apply Mult"),
    ("[1] + 1", "cannot apply Add"),
    ("[1, 0", "neither an int nor a list expression"),
    (True, "expected an int or a list"),
])
def test_moe_layer_freq_errors(value, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_moe_layer_freq(value, 3)
    assert "--moe-layer-freq" in str(e.value)


def test_hybrid_override_pattern():
    assert parse_hybrid_override_pattern("M*-E", 4) == ["M", "*", "-", "E"]
    with pytest.raises(ConfigError, match="has 3 layers, --num-layers is 4"):
        parse_hybrid_override_pattern("M*-", 4)
    with pytest.raises(ConfigError, match=r"\['X', 'm'\] not among M \(Mamba-2\)"):
        parse_hybrid_override_pattern("MXm*", 4)


def test_layer_specs():
    cfg = tiny()
    assert layer_specs(cfg) == [LayerSpec(i, "attention", "dense") for i in range(4)]
    moe = layer_specs(cfg, moe_layers=parse_moe_layer_freq(2, 4))
    assert [s.mlp for s in moe] == ["moe", "dense", "moe", "dense"] and {s.mixer for s in moe} == {"attention"}
    hybrid = layer_specs(cfg, hybrid_layers=parse_hybrid_override_pattern("M*-E", 4))
    assert [(s.index, s.mixer, s.mlp) for s in hybrid] == [(0, "mamba", None), (1, "attention", None),
                                                           (2, None, "dense"), (3, None, "moe")]
    with pytest.raises(ConfigError, match="exclude each other"):
        layer_specs(cfg, moe_layers=[1] * 4, hybrid_layers="****")
    with pytest.raises(ConfigError, match="has 2 entries"):
        layer_specs(cfg, moe_layers=[1, 0])
    with pytest.raises(ValueError, match="neither a mixer nor an MLP"):
        LayerSpec(0, None, None)
    with pytest.raises(ValueError, match="mlp 'sparse' is not one of"):
        LayerSpec(0, "attention", "sparse")


def test_moe_layer_needs_num_experts():  # (MoE layers exist: tests/unit/test_moe.py)
    with pytest.raises(ConfigError, match="layer 2 is a mixture-of-experts layer: set --num-experts"):
        TransformerLayer(tiny(), Parallel(), LayerSpec(2, "attention", "moe"))


def test_layer_knows_its_global_index_and_keeps_its_names():
    m = GPTModel(tiny(), 64, layer_offset=2, num_layers=2, pre_process=False)
    assert [layer.index for layer in m.decoder.layers] == [2, 3]
    names = [n for n, _ in m.decoder.layers[0].named_parameters()]
    assert names == ["input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                     "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                     "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                     "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]


def test_hybrid_attention_then_mlp_layers_equal_one_transformer_layer():
    """'*-' (an attention-only layer, then an MLP-only one) computes what one full layer does."""
    cfg, par = tiny(), Parallel()
    torch.manual_seed(0)
    full = TransformerLayer(cfg, par, LayerSpec(0))
    attn = TransformerLayer(cfg, par, LayerSpec(0, "attention", None))
    mlp = TransformerLayer(cfg, par, LayerSpec(1, None, "dense"))
    assert attn.mlp is None and attn.pre_mlp_layernorm is None
    assert mlp.self_attention is None and mlp.input_layernorm is None
    sd = full.state_dict()
    attn.load_state_dict({k: v for k, v in sd.items() if k.startswith(("input_layernorm.", "self_attention."))})
    mlp.load_state_dict({k: v for k, v in sd.items() if k.startswith(("pre_mlp_layernorm.", "mlp."))})
    x, ctx = torch.randn(8, 2, 32), ForwardContext()
    assert torch.equal(mlp(attn(x, ctx), ctx), full(x, ctx))


def test_forward_context_refuses_what_it_cannot_do_yet():
    with pytest.raises(NotImplementedError, match="KV cache under context parallelism"):
        ForwardContext(kv_cache=object(), cp=object())
    with pytest.raises(ValueError, match="causal=False"):
        ForwardContext(mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))


def test_attention_reads_causal_and_mask_from_the_context():
    torch.manual_seed(0)
    attn = Attention(tiny(), Parallel()).eval()
    x = torch.randn(8, 2, 32)
    causal = attn(x, ForwardContext())
    tril = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    assert torch.allclose(attn(x, ForwardContext(mask=tril, causal=False)), causal, atol=1e-6)
    bidirectional = attn(x, ForwardContext(causal=False))
    assert torch.allclose(bidirectional[-1], causal[-1], atol=1e-6)  # the last position sees all in both
    assert not torch.allclose(bidirectional[0], causal[0], atol=1e-3)


def test_meta_model_builds_without_drawing_or_memory():
    cfg = tiny(position_embedding_type="rope", max_position_embeddings=1 << 20)
    before = torch.get_rng_state()
    m = GPTModel(cfg, 64, device="meta")
    assert torch.equal(before, torch.get_rng_state())
    assert all(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
