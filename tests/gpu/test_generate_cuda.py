"""Generation on CUDA (device machine only): the compiled decode step replayed as a CUDA graph gives the
tokens and log-probabilities of the eager engine, over several batches (new shapes, a second capture)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(**extra):
    """A two-layer llama-style GPT in fp32 on the GPU, seeded (``extra``: more ModelConfig fields)."""
    from paratron.config import ModelConfig
    from paratron.model.gpt import GPTModel
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                    num_query_groups=2, seq_length=256, max_position_embeddings=256, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    hidden_dropout=0.0, attention_dropout=0.0, **extra)
    torch.manual_seed(0)
    return GPTModel(m.resolved(), 512, device="cuda", dtype=torch.float32).eval()


def test_cuda_graph_decode_equals_eager():
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    model = _model()
    eager, graphed = Engine(model, 500), Engine(model, 500, compile=True)
    for batch, n in ((3, 40), (3, 40), (8, 100)):
        g = torch.Generator().manual_seed(batch + n)
        reqs = [Request(torch.randint(0, 500, (5 + 3 * i,), generator=g).tolist(),
                        SamplingParams(n, logprobs=True, temperature=0.8 if i % 2 else 0.0, seed=i))
                for i in range(batch)]
        want, got = eager.generate(reqs), graphed.generate(reqs)
        for w, r in zip(want, got):
            assert r.tokens == w.tokens
            assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(w.logprobs), atol=1e-3)
    assert graphed.graph is not None and graphed.graph.graph is not None  # captured and replayed


def test_cuda_graph_speculative_equals_plain():
    """Speculative decoding with --torch-compile (verification and greedy drafting replayed as CUDA graphs) gives
    plain greedy decoding's tokens, over two batches (the graphs captured once, replayed again)."""
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    model = _model(mtp_num_layers=2)
    plain, spec = Engine(model, 500), Engine(model, 500, compile=True, num_speculative_tokens=2)
    for batch in (1, 1, 4):
        g = torch.Generator().manual_seed(batch)
        reqs = [Request(torch.randint(0, 500, (9 + 2 * i,), generator=g).tolist(), SamplingParams(60, logprobs=True))
                for i in range(batch)]
        for w, r in zip(plain.generate(reqs), spec.generate(reqs)):
            assert r.tokens == w.tokens
            assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(w.logprobs), atol=1e-3)
    steps = spec.speculative_steps
    assert steps.verifier.runner.graph is not None and steps.drafter.runner.graph is not None
    reqs = [Request(list(range(5 + i, 40 + i)), SamplingParams(60)) for i in range(4)]  # run ahead of the host
    for w, r in zip(plain.generate(reqs), spec.generate(reqs)):
        assert r.tokens == w.tokens
    assert spec.acceptance.ahead > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_all_greedy_graph_decode_equals_eager(batch):
    """Every row greedy and nothing reading each step: the rows' tokens are the graph's own argmax buffer, kept
    between the host's reads (engine.SYNC_EVERY steps) as copies; they equal the eager engine's (the same check as
    benchmarks/probes/greedy_alias.py on the branch `probes`, run on an H100 in
    benchmarks/results/decode_probes_h100_20261207.md)."""
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    model = _model(init_method_std=0.3)
    reqs = [Request(list(range(5 + i, 20 + 2 * i)), SamplingParams(48)) for i in range(batch)]
    want = [r.tokens for r in Engine(model, 500).generate(reqs)]
    assert any(len(set(t[:16])) > 1 for t in want)  # tokens that change within one read's steps
    assert [r.tokens for r in Engine(model, 500, compile=True).generate(reqs)] == want
