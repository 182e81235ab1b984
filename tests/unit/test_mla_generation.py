"""Multi-latent attention generation with its latent KV cache: greedy tokens and log-probabilities equal
transformers' DeepSeek-V3 (a random model with a dense and an MoE layer: sigmoid routing with expert bias, groups,
scaling and a shared expert) converted through paratron's Hugging Face conversion; the absorbed decode (W_UK in the
query, W_UV on the output) equals the up-projected prompt pass; the conversion round-trips."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.convert import from_hf  # noqa: E402
from paratron.checkpoint.hf import hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.checkpoint.hf_config import ConversionError, model_config_from_hf  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.load import load_for_inference  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402

VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42]]


def deepseek_config(**over):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2,
              n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
              norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                               "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                               "beta_fast": 32.0, "beta_slow": 1.0},
              rope_interleave=True, attention_bias=False, bos_token_id=0, eos_token_id=0)
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


def deepseek_model():
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(deepseek_config()).eval()
    randomize(hf)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)) * 1.5)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek")
    hf = deepseek_model()
    hf.save_pretrained(d / "hf")
    from_hf(d / "hf", d / "ckpt")
    return hf, d


def test_mla_greedy_equals_transformers_deepseek_v3(converted):
    hf, d = converted
    refs = []
    for p in PROMPTS:
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        with torch.no_grad():
            lp = torch.log_softmax(hf(ref[None]).logits[0].float(), -1)
        refs.append((ref[len(p):].tolist(), lp[len(p) - 1:-1].gather(-1, ref[len(p):, None])[:, 0]))
    for source in ("hf", "ckpt"):
        loaded = load_for_inference(d / source)
        results = Engine(loaded.model, loaded.vocab_size).generate(
            [Request(p, SamplingParams(max_new_tokens=10, logprobs=True)) for p in PROMPTS])
        for (tokens, logprobs), res in zip(refs, results):
            assert res.tokens == tokens, source
            assert torch.allclose(torch.tensor(res.logprobs), logprobs, atol=1e-4), source


def test_absorbed_decode_equals_prompt_pass(converted):
    """Every decode step's logits (absorbed projections over the latent cache) equal those of the whole sequence
    run as one prompt (per-head keys and values up-projected), in fp32."""
    _, d = converted
    model = load_for_inference(d / "ckpt").model
    engine = Engine(model, VOCAB)
    steps = []
    original = engine.decode_step

    def record(tokens, slot):
        out = original(tokens, slot)
        steps.append(out)
        return out

    engine.decode_step = record
    res = engine.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=8))])[0]
    seq = torch.tensor([PROMPTS[0] + res.tokens])
    with torch.no_grad():
        full = model(seq)[0, :, :VOCAB]
    n = len(PROMPTS[0])
    assert len(steps) == 7
    for i, logits in enumerate(steps):  # step i fed generated token i at position n + i
        assert torch.allclose(logits[0], full[n + i], atol=2e-5, rtol=1e-5)


def test_deepseek_conversion_round_trips_and_refuses(converted):
    hf, _ = converted
    cfg, vocab, family = model_config_from_hf(hf.config.to_dict())
    assert family == "deepseek_v3" and cfg.multi_latent_attention and cfg.num_experts == 4
    assert cfg.moe_router_group_topk == 1 and cfg.moe_shared_expert_intermediate_size == 16
    from paratron.checkpoint.hf_moe import per_expert_state
    files = per_expert_state(hf.state_dict(), "deepseek_v3")
    state = hf_to_paratron(files, cfg, family, 128, vocab_size=vocab)
    back = paratron_to_hf(state, cfg, family, vocab)
    assert back.keys() == files.keys() and all(torch.equal(back[k], files[k]) for k in files)
    for bad, why in ((dict(rope_interleave=False), "rope_interleave"), (dict(norm_topk_prob=False), "norm_topk_prob"),
                     (dict(n_group=2, topk_group=1, num_experts_per_tok=3), "group-limited")):
        with pytest.raises(ConversionError, match=why):
            model_config_from_hf(deepseek_config(**bad).to_dict())


def test_paratron_mla_checkpoint_exports_as_deepseek_v3(converted, tmp_path):
    """``paratron convert --to hf`` of the converted checkpoint picks deepseek_v3 and gives transformers' logits."""
    from paratron.checkpoint.convert import to_hf
    hf, d = converted
    to_hf(d / "ckpt", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, hf(ids).logits, atol=1e-5)


def test_paged_engine_serves_multi_latent_attention(converted):
    """The paged engine's latent rows ([c ; k_pe] per token, one 'group' of the paged attention): a shared prefix
    through the prefix cache, then mixed-length requests with chunked prefill in a pool small enough to preempt,
    give the fixed-batch engine's greedy tokens and log-probabilities (transformers' DeepSeek-V3, above)."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.paged import PagedEngine
    _, d = converted
    loaded = load_for_inference(d / "ckpt")
    engine = Engine(loaded.model, loaded.vocab_size)
    shared = [20, 21, 22, 23, 24, 25, 26, 27]
    params = SamplingParams(max_new_tokens=9, logprobs=True)
    plain = SamplingParams(max_new_tokens=9)  # (a request for prompt log-probabilities computes its whole prompt)
    first = [Request(shared + [30, 31], plain), Request(shared + [40], plain)]
    mixed = [Request(p, params) for p in PROMPTS + [shared + [50], [9] * 13]]
    cfg = InferenceConfig(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
                          inference_dynamic_batching_num_blocks=14, inference_dynamic_batching_max_tokens=8,
                          enable_chunked_prefill=True, inference_dynamic_batching_prefix_caching=True,
                          inference_dynamic_batching_prefix_caching_eviction_policy="lru")
    paged = PagedEngine(engine, cfg)
    assert "multi-latent attention, windows, sinks or recurrent layers: not yet" in paged.startup_line()
    got = [paged.generate([r])[0] for r in first]  # one after another: the second reuses the first's blocks
    assert paged.sched.prefix_hits == 2
    got += paged.generate(mixed)
    assert paged.sched.preemptions > 0
    for r, res in zip(first + mixed, got):
        want = engine.generate([r])[0]
        assert res.tokens == want.tokens, r.prompt
        if r.params.logprobs:
            assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(want.logprobs), atol=1e-4), r.prompt
