"""BertModel against transformers' MegatronBertForPreTraining / MegatronBertForMaskedLM: logits equal within 1e-5
(fp32) after converting either way; BertForMaskedLM refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.checkpoint.hf_bert import bert_config_from_hf, bert_hf_to_paratron, bert_paratron_to_hf, hf_bert_config
from paratron.checkpoint.hf_config import ConversionError
from paratron.model.bert import BertModel

transformers = pytest.importorskip("transformers")


def _hf(masked_lm: bool = False, seed: int = 0):
    config = transformers.MegatronBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, max_position_embeddings=16, layer_norm_eps=1e-5,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config.architectures = ["MegatronBertForMaskedLM" if masked_lm else "MegatronBertForPreTraining"]
    cls = transformers.MegatronBertForMaskedLM if masked_lm else transformers.MegatronBertForPreTraining
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms too, so every mapping matters
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    types = torch.zeros(2, 12, dtype=torch.long)
    types[:, 6:] = 1
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    return ids, types, mask


def _hf_logits(model, masked_lm: bool):
    ids, types, mask = _inputs()
    types = torch.zeros_like(types) if masked_lm else types  # (no binary head: no token types)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return (out.logits, None) if masked_lm else (out.prediction_logits, out.seq_relationship_logits)


@pytest.mark.parametrize("masked_lm,layernorm_1p", [(False, False), (True, False), (False, True)])
def test_logits_equal_transformers_both_ways(masked_lm, layernorm_1p):
    hf = _hf(masked_lm)
    cfg, vocab, binary = bert_config_from_hf(hf.config.to_dict())
    assert binary == (not masked_lm) and cfg.model == "bert"
    if layernorm_1p:
        cfg = dataclasses.replace(cfg.unfrozen(), apply_layernorm_1p=True).resolved()
    state = bert_hf_to_paratron(hf.state_dict(), cfg, 128, binary)
    model = BertModel(cfg, 128).eval()
    model.load_state_dict(state, strict=True)
    ids, types, mask = _inputs()
    with torch.no_grad():
        logits, binary_logits = model(ids, padding_mask=mask, tokentype_ids=types if binary else None)
    want, want_binary = _hf_logits(hf, masked_lm)
    torch.testing.assert_close(logits[..., :vocab], want, atol=1e-5, rtol=1e-5)
    if binary:
        torch.testing.assert_close(binary_logits, want_binary, atol=1e-5, rtol=1e-5)
    # back: paratron -> Hugging Face loads strictly into a fresh model with the same logits
    back = bert_paratron_to_hf(model.state_dict(), cfg, vocab, binary)
    config = transformers.MegatronBertConfig(**{k: v for k, v in hf_bert_config(cfg, vocab).items()
                                                if k not in ("model_type", "architectures")})
    fresh = (transformers.MegatronBertForMaskedLM if masked_lm else transformers.MegatronBertForPreTraining)(config)
    missing, unexpected = fresh.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.bias"}  # (tied to cls.predictions.bias)
    fresh.eval()
    got, got_binary = _hf_logits(fresh, masked_lm)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if binary:
        torch.testing.assert_close(got_binary, want_binary, atol=1e-5, rtol=1e-5)


def test_post_layernorm_bert_is_refused_by_name():
    with pytest.raises(ConversionError, match="post-LayerNorm"):
        bert_config_from_hf({"model_type": "bert", "hidden_size": 32})


def test_bert_flops_count_the_whole_attention_and_the_lm_head():
    """The log line's TFLOP/s and MFU for BERT: bidirectional attention is the whole score matrix (GPT's
    formula counts causal attention as half) and the LM head's dense layer adds 6 h^2 per token; the same count
    as the GPU benchmark's (benchmarks/train_throughput.py --bert)."""
    import sys
    from pathlib import Path
    from paratron.config import ModelConfig
    from paratron.plan.flops import flops_per_iteration
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from train_throughput import BERT_340M, bert_flops_per_token
    m = BERT_340M
    base = dict(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                seq_length=m["seq"], max_position_embeddings=m["seq"])
    bert = ModelConfig(model="bert", **base).resolved()
    gpt = ModelConfig(**base).resolved()
    per_token = flops_per_iteration(bert, m["vocab"], 2, m["seq"]) / (2 * m["seq"])
    assert per_token == pytest.approx(bert_flops_per_token(m), rel=1e-12)
    h, s, L = m["hidden"], m["seq"], m["layers"]
    gap = flops_per_iteration(bert, m["vocab"], 1, s) - flops_per_iteration(gpt, m["vocab"], 1, s)
    assert gap == pytest.approx(s * 6 * h * h + s * s * 6 * h * L, rel=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_the_masked_lm_loss_takes_the_one_pass_kernel_unless_the_plain_loss_is_asked(monkeypatch, fused):
    """BERT's per-token loss through parallel/cross_entropy.py's logits_cross_entropy (the one-pass kernel where it
    applies) unless --no-fused-output-loss (model.fused_output_loss False, as the training step sets it): the plain
    vocab-parallel loss then. The same values either way on the CPU."""
    from paratron.model import bert as bert_mod
    hf = _hf()
    cfg, vocab, _ = bert_config_from_hf(hf.config.to_dict())
    model = BertModel(cfg, 128).eval()
    model.load_state_dict(bert_hf_to_paratron(hf.state_dict(), cfg, 128, True), strict=True)
    model.fused_output_loss = fused
    calls, real = [], bert_mod.logits_cross_entropy
    monkeypatch.setattr(bert_mod, "logits_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, types, mask = _inputs()
    labels = torch.where(torch.arange(12) % 3 == 0, ids, torch.full_like(ids, -1))
    with torch.no_grad():
        loss, _ = model(ids, padding_mask=mask, tokentype_ids=types, lm_labels=labels)
        logits, _ = model(ids, padding_mask=mask, tokentype_ids=types)
    assert calls == ([1] if fused else [])
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.clamp(min=0).flatten(),
                                             reduction="none").view(2, 12)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
