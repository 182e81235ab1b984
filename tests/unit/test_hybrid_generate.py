"""Generation with hybrid stacks: Mamba-2 and Gated DeltaNet layers keep their recurrent and convolution states as
the cache (no keys and values). Each decode step's distribution, for a left-padded batch, equals the whole prefix
run from scratch; a prompt joining a running batch in a row of its own (continuous batching) starts from fresh
states."""
import torch

from paratron.inference.cache import KVCache
from paratron.inference.engine import Engine, Request
from paratron.inference.sampling import SamplingParams
from paratron.model.gpt import GPTModel
from tests.unit.test_hybrid_model import hybrid

VOCAB = 64
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42]]  # different lengths: left padding


def model():
    torch.manual_seed(0)
    m = GPTModel(hybrid(hybrid_layer_pattern="MG*-", mamba_chunk_size=4), VOCAB).eval()
    with torch.no_grad():  # sharper than the default init: no near-ties between greedy choices
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return m


def test_cache_holds_states_not_keys_for_recurrent_layers():
    cache = KVCache(model(), 2, 16)
    names = {n for n, _ in cache.named_buffers()}
    assert {"conv0", "ssm0", "conv1", "ssm1", "k2", "v2"} <= names and "k0" not in names and "k1" not in names
    assert cache.ssm0.shape == (2, 8, 8, 8) and cache.ssm0.dtype == torch.float32  # heads, head dim, state dim


def test_decode_equals_full_recompute():
    m = model()
    params = SamplingParams(max_new_tokens=8, logprobs=True)
    results = Engine(m, VOCAB).generate([Request(p, params) for p in PROMPTS])
    for p, r in zip(PROMPTS, results):
        seq = torch.tensor([p + r.tokens])
        with torch.no_grad():
            lp = torch.log_softmax(m(seq)[0, :, :VOCAB], -1)
        want = lp[len(p) - 1:-1].gather(-1, seq[0, len(p):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-5, rtol=1e-5)
        assert r.tokens == lp[len(p) - 1:-1].argmax(-1).tolist()


def test_prompt_joining_a_row_starts_from_fresh_states():
    """Continuous batching's prefill of one row (Engine.prefill_row) over a cache that held another batch: the
    row's logits are the prompt's own, then a decode step of that row goes on from its states."""
    m = model()
    engine = Engine(m, VOCAB)
    engine.generate([Request(p, SamplingParams(max_new_tokens=3)) for p in PROMPTS[:2]])
    prompt = PROMPTS[2]
    with torch.no_grad():
        got = engine.prefill_row(1, prompt, at=9, need_all=True)
        want = m(torch.tensor([prompt + [7]]))[0, :, :VOCAB]
        torch.testing.assert_close(got, want[:-1], atol=1e-5, rtol=1e-5)
        step = engine.decode_step(torch.tensor([[1], [7]]), torch.tensor(9))
    torch.testing.assert_close(step[1, :VOCAB], want[-1], atol=1e-5, rtol=1e-5)


def test_paged_engine_keeps_a_state_row_per_request():
    """A hybrid stack (Mamba-2, Gated DeltaNet, attention) through the paged engine: each request keeps a row of
    recurrent states (a step's prompt chunks packed into one pass, a document each over its row; chunked prefill
    carries the states between chunks), the attention layer through the blocks; a pool small enough to preempt
    (a preempted request's reused row starts afresh); the fixed-batch engine's tokens and
    log-probabilities; prefix caching refused by name."""
    import pytest
    from paratron.config.inference import InferenceConfig
    from paratron.config import ConfigError
    from paratron.inference.paged import PagedEngine
    engine = Engine(model(), VOCAB)
    params = SamplingParams(max_new_tokens=8, logprobs=True)
    reqs = [Request(p, params) for p in PROMPTS + [list(range(20, 27)), [9] * 6]]  # (a context of 16)
    cfg = dict(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
               inference_dynamic_batching_num_blocks=10, inference_dynamic_batching_max_tokens=6,
               enable_chunked_prefill=True, inference_dynamic_batching_max_requests=3)
    paged = PagedEngine(engine, InferenceConfig(**cfg))
    got = paged.generate(reqs)
    assert paged.sched.preemptions > 0 and "recurrent layers: not yet" in paged.startup_line()
    held = sum(b.numel() * b.element_size() for n, b in paged.cache.named_buffers() if n.startswith(("conv", "ssm")))
    assert paged.state_bytes == held > 0 and "recurrent states: 3 rows" in paged.startup_line()  # (reserved on GPUs)
    assert not paged.states.held and len(paged.states.free) == 3  # every row given back
    for r, res in zip(reqs, got):
        want = engine.generate([r])[0]
        assert res.tokens == want.tokens, r.prompt
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="without --inference-dynamic-batching-prefix-caching"):
        PagedEngine(engine, InferenceConfig(**cfg, inference_dynamic_batching_prefix_caching=True))
