"""The compiled decode step computes greedy decoding's argmax itself (inference/graphs.py ``with_argmax``): the engine
hands it to the sampler, the tokens are those of the uncompiled engine, and logits the step did not return get
their argmax computed as before. torch.compile is replaced by the identity here (the CPU has no CUDA graph either):
what is checked is the engine's bookkeeping, not Inductor."""
import torch

from paratron.inference import graphs
from paratron.inference.engine import Engine, Request
from paratron.inference.sampling import Sampler, SamplingParams
from tests.unit.test_generate import PROMPTS, VOCAB, tiny_model


def test_the_compiled_step_argmax_reaches_the_sampler_and_gives_the_same_tokens(monkeypatch):
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=6)
    want = [r.tokens for r in Engine(model, VOCAB).generate([Request(p, params) for p in PROMPTS[:2]])]
    monkeypatch.setattr(graphs.torch, "compile", lambda fn, **_: fn)
    given = []
    real = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, best=None: given.append(best) or real(self, logits,
                                                                                                        best))
    engine = Engine(model, VOCAB, compile=True)
    got = [r.tokens for r in engine.generate([Request(p, params) for p in PROMPTS[:2]])]
    assert got == want
    # the prefill's logits have no argmax of the step; every decode step's has one
    assert given[0] is None and len(given) == 6 and all(b is not None for b in given[1:])
    assert engine.argmax_of(torch.zeros(2, VOCAB)) is None  # logits the step did not return
    # logits the step returned, then a row written (a request joining a running batch): computed again
    logits = engine._step(torch.tensor([[5], [6]]), 9)
    assert engine.argmax_of(logits) is not None
    logits[1] = torch.arange(VOCAB, dtype=logits.dtype)
    assert engine.argmax_of(logits) is None


def test_sampler_takes_a_given_argmax_for_greedy_rows_only():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    best = torch.tensor([2, 2])  # deliberately not the argmax: the sampler must use what it is given
    greedy = Sampler([SamplingParams(4), SamplingParams(4)], "cpu")
    assert greedy(logits, best).tolist() == [2, 2] and greedy(logits).tolist() == [1, 0]
    mixed = Sampler([SamplingParams(4), SamplingParams(4, temperature=1.0, top_k=1)], "cpu")
    assert mixed(logits, best).tolist() == [2, 0]  # the sampled row draws from its own top-1


def test_the_chunked_argmax_is_torchs_argmax_ties_and_padding_included():
    torch.manual_seed(0)
    for b, v in ((1, 32768), (3, 1000), (2, 512), (1, 7)):
        x = torch.randn(b, v)
        assert torch.equal(graphs.chunked_argmax(x), x.argmax(-1))
        x = torch.randint(0, 3, (b, v)).float()  # many ties: the first index of the maximum
        assert torch.equal(graphs.chunked_argmax(x), x.argmax(-1))
        x = torch.full((b, v), float("-inf"))
        assert torch.equal(graphs.chunked_argmax(x), x.argmax(-1))
    x = torch.zeros(2, 1500, dtype=torch.bfloat16)
    x[0, 1400], x[1, 3], x[1, 900] = 1.0, 2.0, 2.0  # in the last, padded chunk; the same maximum in two chunks
    assert graphs.chunked_argmax(x).tolist() == [1400, 3]
