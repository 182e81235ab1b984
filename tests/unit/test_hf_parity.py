"""Logit parity with Hugging Face transformers: a tiny random HF model, converted with hf_to_paratron and
loaded strictly into GPTModel, gives the same logits (fp32, CPU, eval) within 1e-5.

Every parameter (norm weights and biases included) is drawn at a scale that makes attention sharp, so a
wrong head layout, a swapped k/v or a missing bias shows up as an O(1) difference.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import hf_config as HC  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402

VOCAB = 100  # padded to 128 in paratron
TOL = 1e-5

_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0,
                   rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# name -> (model_type, config kwargs, position offset of the test tokens)
CASES = {
    "gpt2-tied": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), 0),
    "gpt2-untied-exact-gelu": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_inner=80, vocab_size=VOCAB,
                                            n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            activation_function="gelu", tie_word_embeddings=False,
                                            bos_token_id=0, eos_token_id=0), 0),
    "llama-gqa-untied": ("llama", dict(_LLAMA_LIKE), 0),
    # Llama-3.1 rope scaling only changes the low frequencies: test at positions past 8000.
    "llama-rope-scaling-tied-bias": ("llama", dict(_LLAMA_LIKE, max_position_embeddings=16384,
                                                   rope_parameters=dict(_LLAMA3_ROPE), tie_word_embeddings=True,
                                                   attention_bias=True, mlp_bias=True), 8000),
    "mistral-head-dim": ("mistral", dict(_LLAMA_LIKE, head_dim=32, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6}), 0),
    "qwen2-qkv-bias-tied": ("qwen2", dict(_LLAMA_LIKE, tie_word_embeddings=True), 0),
    "qwen3-qk-norm": ("qwen3", dict(_LLAMA_LIKE, head_dim=16), 0),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights ~1+N(0, .2), biases ~N(0, .2), matrices ~N(0, 1/fan_in), embeddings ~N(0, .3)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                is_norm = any(k in name for k in ("norm", "ln_", "layernorm"))
                p.copy_(1 + 0.2 * r if is_norm and name.endswith("weight") else 0.2 * r)
            elif any(k in name for k in ("wte", "wpe", "embed")):
                p.copy_(0.3 * r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)


def build_hf(model_type: str, kwargs: dict, attn: str = "eager"):
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    randomize(model)
    return model.eval()


def to_paratron(hf_model):
    cfg, vocab, family = HC.model_config_from_hf(hf_model.config)
    padded = HC.padded_vocab_size(vocab, cfg)
    model = GPTModel(cfg, padded)
    model.load_state_dict(H.hf_to_paratron(hf_model.state_dict(), cfg, family, padded), strict=True)
    return model.eval(), vocab, padded


def tokens(offset: int = 0, b: int = 2, s: int = 16):
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(offset, offset + s).expand(b, s)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case):
    model_type, kwargs, offset = CASES[case]
    hf_model = build_hf(model_type, kwargs)
    model, vocab, padded = to_paratron(hf_model)
    assert model.config.hidden_dropout == 0.0 and model.config.attention_dropout == 0.0
    ids, pos = tokens(offset)
    with torch.no_grad():
        ref = hf_model(input_ids=ids, position_ids=pos).logits
        out = model(ids, position_ids=pos)
    assert out.shape == (2, 16, padded) and padded == 128
    diff = (out[..., :vocab] - ref).abs().max().item()
    assert diff <= TOL, f"{case}: max |paratron - HF| = {diff:.3g}"
    assert torch.count_nonzero(out[..., vocab:]) == 0  # padded rows are zeros


def test_sdpa_attention_matches_too():
    hf_model = build_hf("llama", dict(_LLAMA_LIKE), attn="sdpa")
    model, vocab, _ = to_paratron(hf_model)
    ids, pos = tokens()
    with torch.no_grad():
        diff = (model(ids)[..., :vocab] - hf_model(input_ids=ids).logits).abs().max().item()
    assert diff <= TOL


def test_rope_scaling_is_exercised():
    """Without the Llama-3 scaling the same weights give visibly different logits at these positions,
    so the parity case above really checks the scaling."""
    model_type, kwargs, offset = CASES["llama-rope-scaling-tied-bias"]
    hf_model = build_hf(model_type, kwargs)
    cfg, vocab, family = HC.model_config_from_hf(hf_model.config)
    assert cfg.use_rope_scaling and cfg.rope_scaling_factor == 8.0 and cfg.rotary_base == 500000.0
    cfg = cfg.resolved(use_rope_scaling=False)  # a frozen config: a changed copy
    model = GPTModel(cfg, 128)
    model.load_state_dict(H.hf_to_paratron(hf_model.state_dict(), cfg, family, 128))
    ids, pos = tokens(offset)
    with torch.no_grad():
        diff = (model.eval()(ids, position_ids=pos)[..., :vocab] - hf_model(input_ids=ids, position_ids=pos).logits)
    assert diff.abs().max().item() > 1e-3


def test_per_token_loss_on_unpadded_logits_matches_hf():
    hf_model = build_hf("llama", dict(_LLAMA_LIKE))
    model, vocab, _ = to_paratron(hf_model)
    ids, _ = tokens()
    with torch.no_grad():
        ref = hf_model(input_ids=ids, labels=ids).loss
        logits = model(ids[:, :-1])[..., :vocab]
        ours = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    assert abs(ours.item() - ref.item()) <= TOL
