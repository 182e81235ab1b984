"""The paged engine over hybrid stacks (a NemotronH-like Mamba-2 stack, a Qwen3-Next-like Gated DeltaNet one):
many concurrent requests of mixed lengths, their prompts cut into chunks by a small token budget, give each
request's alone result and the fixed-batch engine's; a step's prompt chunks run in one packed forward pass
beside the one of its decodes (kernels/varlen.py: per-document states, no leakage between documents)."""
from __future__ import annotations

import random

import pytest
import torch

from paratron.config.inference import InferenceConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.sampling import SamplingParams
from paratron.model.gpt import GPTModel
from tests.unit.test_hybrid_model import hybrid
from tests.threads import one_thread  # noqa: F401  (autouse: one intra-op thread)

VOCAB = 64
MODELS = {"nemotron_h": dict(hybrid_layer_pattern="M*M-"), "qwen3_next": dict(hybrid_layer_pattern="G*G-"),
          "latent": dict(hybrid_layer_pattern="M*G-", multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8,
                         qk_pos_emb_head_dim=8, v_head_dim=8)}  # (its decodes join the packed pass)


def model(kw: dict) -> GPTModel:
    torch.manual_seed(0)
    m = GPTModel(hybrid(**kw, mamba_chunk_size=4, seq_length=24), VOCAB).eval()
    with torch.no_grad():  # sharper than the default init: no near-ties between greedy choices
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return m


def requests(n: int, seed: int) -> list[Request]:
    """Prompts of 1 to 13 tokens (lengths that are not multiples of the chunk of 4 among them); every third asks
    for log-probabilities (its whole prompt's logits are picked)."""
    rng = random.Random(seed)
    return [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 13))],
                    SamplingParams(max_new_tokens=rng.randint(1, 6), logprobs=i % 3 == 0)) for i in range(n)]


def counted(paged: PagedEngine) -> list:
    """[(prompt chunks, decodes, forward passes)] of every step of ``paged`` from now on."""
    steps, schedule, forward = [], paged.sched.schedule, paged.e._forward

    def plan():
        p = schedule()
        decodes = sum(1 for seq, n in p if n == 1 and seq.computed > 0)
        steps.append([len(p) - decodes, decodes, 0])
        return p

    def count(*a, **kw):
        steps[-1][2] += 1
        return forward(*a, **kw)

    paged.sched.schedule, paged.e._forward = plan, count
    return steps


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_prompt_chunks_equal_each_request_alone(name):
    engine = Engine(model(MODELS[name]), VOCAB)
    reqs = requests(10, seed=10)
    cfg = InferenceConfig(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
                          inference_dynamic_batching_max_tokens=9, enable_chunked_prefill=True,
                          inference_dynamic_batching_max_requests=6)
    paged = PagedEngine(engine, cfg)
    steps = counted(paged)
    got = paged.generate(reqs)
    del engine._forward  # (stop counting: the fixed-batch engine's passes below are not the paged engine's)
    batch = engine.generate(reqs)
    for r, res, b in zip(reqs, got, batch):
        alone = engine.generate([r])[0]
        assert res.tokens == alone.tokens == b.tokens, r.prompt
        if r.params.logprobs:
            torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), torch.tensor(alone.prompt_logprobs[1:]),
                                       atol=1e-5, rtol=1e-5)
    assert not paged.states.held and paged.sched.preemptions == 0
    assert max(chunks for chunks, _, _ in steps) >= 3  # steps with several prompts being prefilled
    assert any(chunks > 1 and decodes for chunks, decodes, _ in steps)  # beside decodes
    for chunks, decodes, passes in steps:  # one pass for the prompt chunks, one for the decodes
        want = chunks + decodes > 0 if name == "latent" else (chunks > 0) + (decodes > 0)
        assert passes == want, (chunks, decodes, passes)
