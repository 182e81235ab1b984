"""The parts BERT and T5 share with GPT: bidirectional attention under a key padding mask (ForwardContext),
the transformer stack run as an encoder, tokentype embeddings."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.model.attention import FlashAttention, WindowedAttention
from paratron.model.gpt import Embedding
from paratron.model.layers import ForwardContext, Parallel
from paratron.model.transformer import TransformerStack


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base).resolved()


def _stack(cfg):
    torch.manual_seed(0)
    return TransformerStack(cfg, Parallel(), cfg.num_layers, seed=3).eval()


def test_padding_mask_folds_into_the_mask():
    pad = torch.tensor([[True, True, False], [True, True, True]])
    enc = ForwardContext.bidirectional(pad)
    assert not enc.causal and enc.mask.shape == (2, 1, 1, 3) and enc.mask[0, 0, 0].tolist() == [True, True, False]
    dec = ForwardContext(padding_mask=pad)  # causal + padding: lower triangle and real keys
    assert not dec.causal and dec.mask.shape == (2, 1, 3, 3)
    assert dec.mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert dec.mask[1, 0, 2].tolist() == [True, True, True]
    with pytest.raises(ValueError, match="bool"):
        ForwardContext.bidirectional(pad.long())
    with pytest.raises(ValueError, match="context parallelism"):
        ForwardContext(causal=False, cp=object())


def test_encoder_sees_the_future_and_ignores_padding():
    x = torch.randn(6, 2, 32)  # [s, b, h]
    one = _stack(_cfg(num_layers=1))  # one layer: the last position sees the same keys either way
    torch.testing.assert_close(one(x, ForwardContext.bidirectional())[-1], one(x, ForwardContext())[-1])
    stack = _stack(_cfg())
    full = stack(x, ForwardContext.bidirectional())
    causal = stack(x, ForwardContext())
    assert not torch.allclose(full[0], causal[0], atol=1e-3)  # the first one sees the future only bidirectionally
    # row 0 has 4 real tokens then 2 pads of garbage: its real outputs equal the unpadded run's
    pad = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    y = x.clone()
    y[4:, 0] = 100 * torch.randn(2, 32)
    padded = stack(y, ForwardContext.bidirectional(pad))
    alone = stack(x[:4, :1], ForwardContext.bidirectional())
    torch.testing.assert_close(padded[:4, :1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:, 1:], full[:, 1:], atol=1e-5, rtol=1e-5)


def test_window_core_and_flash_core_honour_the_padding_mask():
    pad = torch.tensor([[True] * 5 + [False] * 3])
    q, k, v = (torch.randn(1, 4, 8, 8) for _ in range(3))
    ctx = ForwardContext.bidirectional(pad)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5])
    win = WindowedAttention(_cfg(window_size="-1,-1", softmax_type="off-by-one"), Parallel())
    sink = win(q, k, v, ctx)  # off-by-one sink: softmax over the real keys plus a zero logit
    assert not torch.allclose(sink, want, atol=1e-3)
    band = WindowedAttention(_cfg(window_size="2,0"), Parallel())(q, k, v, ctx)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    allowed = (j >= i - 2) & (j <= i) & (j < 5)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    torch.testing.assert_close(band[:, :, :5], ref[:, :, :5], atol=1e-5, rtol=1e-5)  # the real queries
    flash = FlashAttention(_cfg(), Parallel())
    assert not flash.applies(ctx) and not flash.applies(ForwardContext.bidirectional())  # SDPA takes them
    out = flash.attend(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), ctx)  # [s, b, heads * d]
    torch.testing.assert_close(out.view(8, 1, 4, 8).permute(1, 2, 0, 3), want, atol=1e-5, rtol=1e-5)


def test_tokentype_embeddings():
    cfg = _cfg()
    torch.manual_seed(0)
    plain = Embedding(cfg, 64, Parallel()).eval()
    torch.manual_seed(0)
    typed = Embedding(cfg, 64, Parallel(), num_tokentypes=2).eval()
    ids, pos = torch.randint(0, 64, (2, 5)), torch.arange(5).expand(2, 5)
    types = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert torch.equal(plain.word_embeddings.weight, typed.word_embeddings.weight)  # drawn after the others
    got = typed(ids, pos, types)
    want = plain(ids, pos) + typed.tokentype_embeddings.weight[types].transpose(0, 1)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="tokentype"):
        typed(ids, pos)
