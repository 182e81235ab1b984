"""Megatron's rotary options: --rotary-interleaved (RoFormer's pairs) against the interleaved formula
written out, --rotary-seq-len-interpolation-factor against positions divided by the factor,
--no-rope-freq (NoPE layers) by what the model's output depends on, and their one-line errors."""
from __future__ import annotations

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig, finalize
from paratron.model.gpt import GPTModel
from paratron.model.layers import Rotary, apply_rotary, apply_rotary_interleaved, rope_inv_freq

S, D = 12, 16


def _model_cfg(**kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=S, max_position_embeddings=S,
                       position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, **kw).resolved()


def _interleaved_reference(x, pos):
    """RoFormer / Megatron's interleaved rotary: each pair (2i, 2i + 1) rotated by position x frequency i."""
    freqs = torch.outer(pos.float(), rope_inv_freq(D, 10000.0))
    emb = freqs.repeat_interleave(2, dim=-1)[:, None, None, :]
    pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * emb.cos() + pairs * emb.sin()


def test_interleaved_rotary_gives_the_interleaved_attention_scores():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, 2, 4, D, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_model_cfg(kv_channels=D))
    cos, sin = (t.double() for t in rot(S, None))
    ours = torch.einsum("sbhd,tbhd->bhst", apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin))
    pos = torch.arange(S)
    want = torch.einsum("sbhd,tbhd->bhst", _interleaved_reference(q, pos), _interleaved_reference(k, pos))
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10)
    halves = torch.einsum("sbhd,tbhd->bhst", apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    assert (halves - want).abs().max() > 1e-2  # the rotate-half form is another embedding


def test_interpolation_factor_divides_the_positions():
    plain, squeezed = Rotary(_model_cfg()), Rotary(_model_cfg(rotary_seq_len_interpolation_factor=4.0))
    freqs = torch.outer(torch.arange(S) / 4.0, rope_inv_freq(plain.dim, 10000.0))
    torch.testing.assert_close(squeezed.cos, torch.cat([freqs, freqs], -1).cos())
    assert not torch.allclose(squeezed.cos, plain.cos)


@pytest.mark.parametrize("pattern,rotates", [("2", [True, False]), ("[1,0]", [False, True]), (None, [True, True])])
def test_no_rope_layers(pattern, rotates):
    model = GPTModel(_model_cfg(no_rope_freq=pattern), 64, seed=1).eval()
    assert [layer.self_attention.rotate is not None for layer in model.decoder.layers] == rotates
    tokens = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(2))
    shuffled = torch.randperm(S, generator=torch.Generator().manual_seed(3))[None]
    nope = GPTModel(_model_cfg(no_rope_freq="[1,1]"), 64, seed=1).eval()
    with torch.no_grad():  # without RoPE anywhere the position ids reach nothing; with it, they do
        assert torch.equal(nope(tokens), nope(tokens, position_ids=shuffled))
        assert not torch.allclose(model(tokens), model(tokens, position_ids=shuffled))


def _resolve(**model):
    cfg = Config()
    cfg.data.mock_data, cfg.data.vocab_size, cfg.optim.lr, cfg.train.train_iters = True, 64, 1e-3, 1
    for k, v in dict(dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=S), **model).items():
        cfg.set(k, v)
    return finalize(cfg, 1)


@pytest.mark.parametrize("flags,message", [
    (dict(rotary_interleaved=True), "--rotary-interleaved has no effect without rotary embeddings"),
    (dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=0.0), "must be > 0"),
    (dict(position_embedding_type="rope", no_rope_freq="[1,0,1]"), "--no-rope-freq has 3 entries"),
    (dict(position_embedding_type="rope", no_rope_freq="0"), "the frequency must be >= 1"),
    (dict(position_embedding_type="yarn", rotary_seq_len_interpolation_factor=2.0), "YaRN scales positions"),
    (dict(multi_latent_attention=True, rotary_interleaved=True), "MLA rotates its own rotary part"),
])
def test_errors_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        _resolve(**flags)
    assert "\n" not in str(e.value)


def test_hf_export_refuses_what_llama_cannot_express():
    from paratron.checkpoint.hf_config import ConversionError, check_representable
    with pytest.raises(ConversionError, match="rotate-half on every layer"):
        check_representable(_model_cfg(rotary_interleaved=True), "llama")


def test_a_checkpoint_with_another_rope_form_is_named():
    """Resuming with --rotary-interleaved or --no-rope-freq changed would train another function: the
    comparison of the saved configuration names them."""
    from paratron.checkpoint.compat import model_differences
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--position-embedding-type", "rope"]
    saved = _parse(base).to_dict()
    got = model_differences(saved, _parse(base + ["--rotary-interleaved", "--no-rope-freq", "2"]))
    assert {name for name, _, _ in got} == {"rotary_interleaved", "no_rope_freq"}
    assert not model_differences(saved, _parse(base + ["--rotary-seq-len-interpolation-factor", "2"]))


def _parse(argv):
    from paratron.config import parse_args
    return parse_args(argv)
