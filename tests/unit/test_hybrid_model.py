"""Hybrid stacks (Mamba-2, Gated DeltaNet, attention, MLP layers by --hybrid-layer-pattern) and GPT stacks with
Gated DeltaNet mixers: the config reads Megatron's flags, the model trains, packed documents do not see each
other, the chunk length does not change the numbers."""
import pytest
import torch

from paratron.config import ConfigError, ModelConfig
from paratron.config.check_hybrid import pattern_from_ratios
from paratron.model.gated_delta_net import GatedDeltaNet
from paratron.model.gpt import GPTModel
from paratron.model.mamba import MambaMixer
from paratron.model.spec import layer_specs

SMALL = dict(hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
             normalization="RMSNorm", position_embedding_type="none", mamba_state_dim=8, mamba_head_dim=8,
             mamba_num_groups=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, disable_bias_linear=True)


def hybrid(**kw) -> ModelConfig:
    return ModelConfig(**{**SMALL, "hybrid_layer_pattern": "M*G-", **kw}).resolved()


def test_pattern_flags():
    cfg = hybrid(num_layers=9)  # the pattern sets the layer count, as Megatron
    assert cfg.num_layers == 4 and cfg.is_hybrid_model
    assert [(s.mixer, s.mlp) for s in layer_specs(cfg)] == [("mamba", None), ("attention", None), ("gdn", None),
                                                            (None, "dense")]
    old = ModelConfig(**SMALL, hybrid_override_pattern="M-M*").resolved()
    assert old.hybrid_layer_pattern == "M-M*" and old.hybrid_override_pattern is None
    gdn = ModelConfig(**SMALL, num_layers=4, experimental_attention_variant="gated_delta_net",
                      linear_attention_freq="2").resolved()
    assert [(s.mixer, s.mlp) for s in layer_specs(gdn)] == [("gdn", "dense"), ("attention", "dense")] * 2
    assert pattern_from_ratios(8, 0.25, 0.0) == "MM*MM*MM" and pattern_from_ratios(10, 0.1, 0.4).count("-") == 4
    spec = ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
    assert ModelConfig(**SMALL, hybrid_layer_pattern="M*", spec=spec).resolved().spec == spec


@pytest.mark.parametrize("kw,match", [
    (dict(hybrid_layer_pattern="M*D"), r"D \(DeepSeek sparse attention\) layers are not implemented"),
    (dict(hybrid_layer_pattern="MX"), "'X' is not a layer symbol"),
    (dict(hybrid_layer_pattern="M*/MM"), "multi-token prediction layers after '/'"),
    (dict(hybrid_layer_pattern="M*", hybrid_override_pattern="M*"), "exclude each other"),
    (dict(mamba_num_groups=3, hybrid_layer_pattern="M"), "not divisible by --mamba-num-groups 3"),
    (dict(experimental_attention_variant="dsa"), "gdn2 and dsa are not implemented"),
    (dict(experimental_attention_variant="gated_delta_net"), "needs --linear-attention-freq"),
    (dict(hybrid_layer_pattern="M*", spec=["my.module", "my_spec"]), "--spec my.module my_spec"),
])
def test_refusals(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**SMALL, **kw}).resolved()


def batch(seed=0, b=2, s=16):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (b, s), generator=gen)
    return ids, torch.roll(ids, -1, 1)


def test_trains_and_every_mixer_gets_gradients():
    torch.manual_seed(0)
    model = GPTModel(hybrid(hybrid_layer_pattern="MG*-"), 64)
    assert isinstance(model.decoder.layers[0].self_attention, MambaMixer)
    assert isinstance(model.decoder.layers[1].self_attention, GatedDeltaNet)
    ids, labels = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(ids, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), "a dead parameter"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_packed_documents_do_not_see_each_other():
    """With document ids (--reset-attention-mask data) the second document's logits equal the logits of that
    document run alone: the convolutions and the scans reset, as attention's mask does."""
    torch.manual_seed(0)
    model = GPTModel(hybrid(hybrid_layer_pattern="MG*-", mamba_chunk_size=4), 64).eval()
    ids, _ = batch(1, b=1)
    docs = torch.tensor([[0] * 6 + [1] * 10])
    pos = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with torch.no_grad():
        packed = model(ids, pos, document_ids=docs)
        alone = model(ids[:, 6:], pos[:, 6:])
        leaked = model(ids, pos)
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-5, atol=1e-5)
    assert (leaked[:, 6:] - alone).abs().max() > 1e-3  # without the resets the first document would leak in


def test_chunk_length_does_not_change_the_numbers():
    ids, _ = batch(2)
    outs = []
    for chunk in (3, 16):
        torch.manual_seed(0)
        model = GPTModel(hybrid(hybrid_layer_pattern="MG", mamba_chunk_size=chunk), 64).eval()
        with torch.no_grad():
            outs.append(model(ids))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_hybrid_mini_preset():
    """configs/hybrid-mini.yaml: the Nemotron-H-like pattern, about 1B parameters (counted on the meta device)."""
    from paratron.train.resolve import parse_args
    cfg = parse_args(["--config", "hybrid-mini"]).model
    specs = layer_specs(cfg)
    assert cfg.num_layers == 36 and [s.mixer for s in specs].count("mamba") == 16
    assert [s.mixer for s in specs].count("attention") == 4 and [s.mlp for s in specs].count("dense") == 16
    n = sum(p.numel() for p in GPTModel(cfg, 32768, device="meta").parameters())
    assert 0.9e9 < n < 1.2e9, n


def test_flops_of_split_layers_equal_the_dense_formula():
    """An attention-only layer then an MLP-only one ('*-') count what one transformer layer does."""
    from paratron.train.metrics import flops_per_iteration
    dense = ModelConfig(**{**SMALL, "num_layers": 2}).resolved()
    split = hybrid(hybrid_layer_pattern="*-*-")
    assert flops_per_iteration(split, 128, 2, 16) == flops_per_iteration(dense, 128, 2, 16)
    mamba = hybrid(hybrid_layer_pattern="M-*-")
    assert flops_per_iteration(mamba, 128, 2, 16) != flops_per_iteration(dense, 128, 2, 16)


def test_moe_layers_in_the_pattern():
    torch.manual_seed(0)
    cfg = hybrid(hybrid_layer_pattern="M*E", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    assert [(s.mixer, s.mlp) for s in layer_specs(cfg)] == [("mamba", None), ("attention", None), (None, "moe")]
    model = GPTModel(cfg, 64)
    ids, labels = batch()
    model(ids, labels=labels).mean().backward()
    assert model.decoder.layers[2].mlp.router.weight.grad.abs().sum() > 0
