"""Sliding-window attention and attention sinks (paratron/model/core_attention.py) against transformers'
gpt-oss attention (eager, with sinks and its sliding-window mask), forward and gradients; Megatron's
layer pattern of --window-attn-skip-freq; the KV-cache path; YaRN rotary tables against transformers;
the one-line configuration errors."""
from __future__ import annotations

import types

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig, finalize
from paratron.model.core_attention import CoreAttention, parse_window_size, window_layers
from paratron.model.gpt import GPTModel
from paratron.model.layers import ForwardContext, Parallel, Rotary

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

B, H, G, S, D = 2, 4, 2, 12, 16


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H * D, num_attention_heads=H, group_query_attention=True,
                num_query_groups=G, seq_length=S, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base).resolved()


def _hf(q, k, v, sinks, hf_window):
    """transformers' gpt-oss eager attention; ``hf_window``: its sliding_window (None: full causal)."""
    fn = causal_mask_function if hf_window is None else sliding_window_causal_mask_function(hf_window)
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = fn(0, 0, qi, ki)
    mask = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=H // G, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
    return out.transpose(1, 2)  # [b, h, s, d]


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
@pytest.mark.parametrize("window", [None, "4,0"])
def test_core_equals_gpt_oss_attention(softmax_type, window):
    """Megatron's window (W-1, 0) is transformers' sliding_window W; sinks as gpt-oss's."""
    cfg = _cfg(window_size=window, softmax_type=softmax_type)
    core = CoreAttention(cfg, Parallel(), 0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64) for n in (H, G, G))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    if softmax_type == "learnable":
        core = core.double()
        with torch.no_grad():
            core.softmax_offset.copy_(sinks)
    else:
        sinks = torch.zeros(H, dtype=torch.float64) if softmax_type == "off-by-one" else torch.full((H,), -torch.inf,
                                                                                                  dtype=torch.float64)
    ours_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_(softmax_type == "learnable")
    ours = core(*ours_in, ForwardContext())
    ref = _hf(*ref_in, ref_sinks, None if window is None else 5)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in zip(ours_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    if softmax_type == "learnable":
        torch.testing.assert_close(core.softmax_offset.grad, ref_sinks.grad, rtol=1e-9, atol=1e-12)


def test_window_with_a_document_mask_and_the_window_is_built_once():
    cfg = _cfg(window_size="2,0", softmax_type="learnable")
    core = CoreAttention(cfg, Parallel(), 0).double()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, S, D, generator=g, dtype=torch.float64) for n in (H, G, G))
    docs = torch.tensor([0] * 5 + [1] * 7)
    doc_mask = (docs[:, None] == docs[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    ctx = ForwardContext(mask=doc_mask[None, None], causal=False)
    out = core(q, k, v, ctx)
    memo = dict(ctx.memo)  # the band and its additive form with the sink column
    assert len(memo) == 2 and core(q, k, v, ctx).equal(out)  # a second layer reuses them
    assert all(ctx.memo[key] is mask for key, mask in memo.items())
    # reference: each query over its allowed keys and the sink, by hand
    kk, vv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    for i in range(S):
        keys = [j for j in range(S) if docs[j] == docs[i] and i - 2 <= j <= i]
        logits = torch.einsum("hd,hkd->hk", q[0, :, i], kk[0, :, keys]) * D ** -0.5
        probs = torch.cat([logits, core.softmax_offset.detach()[:, None]], -1).softmax(-1)[:, :-1]
        want = torch.einsum("hk,hkd->hd", probs, vv[0, :, keys])
        torch.testing.assert_close(out[0, :, i], want, rtol=1e-10, atol=1e-12)


def test_window_layer_pattern_is_megatrons():
    assert window_layers("127,0", 2, 4) == [True, False, True, False]  # layer numbers 2, 4 (1-based): full
    assert window_layers("127,0", 3, 6) == [True, True, False, True, True, False]
    assert window_layers("127,0", None, 3) == [True] * 3
    assert window_layers("127,0", "[1,0]*2", 4) == [True, False, True, False]
    assert window_layers(None, 2, 2) == [False, False]
    assert CoreAttention(_cfg(window_size="-1,0"), Parallel(), 0).window is None  # causal attention as it is
    assert parse_window_size("(127, 0)") == (127, 0) and parse_window_size("-1,0") == (-1, 0)
    for bad in ("127", "a,0", "5,3", "-2,0"):
        with pytest.raises(ConfigError, match="--window-size"):
            parse_window_size(bad)
    with pytest.raises(ConfigError, match="--window-attn-skip-freq has 3 entries"):
        window_layers("4,0", "[1,0,1]", 4)


def _model(**kw):
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                    num_query_groups=2, seq_length=64, hidden_dropout=0.0, attention_dropout=0.0,
                    normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    **kw)
    torch.manual_seed(0)
    model = GPTModel(m.resolved(), 128, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() < 2 or "emb" in name else p.shape[1] ** -0.5) +
                    (1.0 if "norm" in name else 0.0))
    return model


def test_kv_cache_decode_equals_full_recompute():
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    model = _model(window_size="3,0", window_attn_skip_freq="2", softmax_type="learnable")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42]]  # left padding
    results = Engine(model, 100).generate([Request(p, SamplingParams(max_new_tokens=8, logprobs=True))
                                            for p in prompts])
    for p, r in zip(prompts, results):
        seq = torch.tensor([p + r.tokens])
        with torch.no_grad():
            lp = torch.log_softmax(model(seq)[0, :, :100], -1)
        want = lp[len(p) - 1:-1].gather(-1, seq[0, len(p):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-5, rtol=0)
    # the window matters: without it the same weights give other logits
    plain = _model(softmax_type="learnable")
    plain.load_state_dict(model.state_dict())
    seq = torch.tensor([prompts[0] + results[0].tokens])
    with torch.no_grad():
        assert not torch.allclose(plain(seq), model(seq), atol=1e-3)


def test_yarn_rotary_tables_equal_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    m = _cfg(position_embedding_type="yarn", rotary_base=150000.0, rotary_scaling_factor=32.0,
             yarn_original_max_position_embeddings=16, yarn_correction_range_round_to_int=False, seq_length=40)
    hf_cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, max_position_embeddings=40,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                          "original_max_position_embeddings": 16, "truncate": False})
    x = torch.zeros(1, 40, D)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, torch.arange(40)[None])
    ours = Rotary(m)
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)
    assert ours.cos[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1.0)


def _resolve(**model):
    cfg = Config()
    cfg.data.mock_data, cfg.data.vocab_size, cfg.optim.lr, cfg.train.train_iters = True, 64, 1e-3, 1
    for k, v in model.items():
        cfg.set(k, v)
    return finalize(cfg, cfg.parallel.context_parallel_size)


@pytest.mark.parametrize("flags,message", [
    (dict(window_attn_skip_freq="2"), "--window-attn-skip-freq has no effect without --window-size"),
    (dict(softmax_type="softmax1"), "--softmax-type softmax1: choose one of vanilla, off-by-one, learnable"),
    (dict(rope_type="yarn", position_embedding_type="rope"), "--rope-type yarn is for multi-latent attention"),
    (dict(yarn_beta_fast=16.0, position_embedding_type="rope"), "--yarn-beta-fast has no effect without"),
    (dict(rotary_scaling_factor=4.0), "--rotary-scaling-factor has no effect without"),
    (dict(position_embedding_type="yarn", rotary_percent=0.5), "Megatron's YaRN rotates the whole head"),
    (dict(window_size="4,2"), "RIGHT must be 0"),
])
def test_config_errors_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")) as e:
        _resolve(**flags)
    assert "\n" not in str(e.value)


def test_megatron_command_line_spellings():
    from paratron.config import parse_args
    cfg = parse_args(["--mock-data", "--lr", "1e-3", "--train-iters", "1", "--window-size", "127,0",
                      "--window-attn-skip-freq", "2", "--softmax-type", "learnable", "--rope-type", "rope",
                      "--position-embedding-type", "yarn", "--rotary-scaling-factor", "32",
                      "--yarn-original-max-position-embeddings", "4096", "--no-yarn-correction-range-round-to-int",
                      "--seq-length", "64"])
    m = cfg.model
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type, m.rope_type) == ("127,0", "2", "learnable", "rope")
    assert m.rotary_scaling_factor == 32.0 and m.yarn_correction_range_round_to_int is False


def test_paged_engine_windows_and_sinks_equal_the_fixed_engine():
    """gpt-oss's attention (a sliding window on every other layer, learnable sinks) through the paged engine: its
    block tables keep every token, each windowed layer attends over the last window + 1 of them with the sinks in
    the softmax (kernels/paged_attention.py's reference); chunked prefill and preemption change nothing."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import SamplingParams
    engine = Engine(_model(window_size="3,0", window_attn_skip_freq="2", softmax_type="learnable"), 100)
    reqs = [Request(p, SamplingParams(max_new_tokens=8, logprobs=True))
            for p in ([5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42], list(range(20, 33)))]
    cfg = InferenceConfig(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
                          inference_dynamic_batching_num_blocks=10, inference_dynamic_batching_max_tokens=6,
                          enable_chunked_prefill=True)
    paged = PagedEngine(engine, cfg)
    got = paged.generate(reqs)
    assert paged.sched.preemptions > 0
    for r, res in zip(reqs, got):
        want = engine.generate([r])[0]
        assert res.tokens == want.tokens, r.prompt
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
