"""Speculative decoding from MTP depths (paratron/inference/speculative.py): greedy output and log-probabilities equal
plain decoding's, with drafts always rejected (random MTP weights) and mostly accepted (MTP depths that predict as
the main model does, slightly perturbed); the sampling rule's output distribution equals the target's exactly
(every draft and a grid of uniform draws enumerated); flag errors."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.sampling import SamplingParams
from paratron.inference.speculative import SpeculativeRun, accept
from paratron.model.gpt import GPTModel
from tests.unit.test_generate import PROMPTS, VOCAB, sharpen


def mtp_model(layers: int = 2, depths: int = 2, **extra) -> GPTModel:
    m = ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=64,
                    max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
                    disable_bias_linear=True, mtp_num_layers=depths, **extra)
    torch.manual_seed(0)
    model = GPTModel(m.resolved(), 128, seed=3).eval()
    sharpen(model, 1)
    return model


def bigram_drafter(model: GPTModel, attention: float, noise: float) -> GPTModel:
    """A one-layer model whose attention is scaled by ``attention`` (small: the next token depends mostly on the
    current one) and whose MTP depths are copies of its layer reading the embedding only (eh_proj = [I, 0]), so
    each depth predicts as the model itself does; ``noise`` perturbs the depths' MLPs (some drafts rejected)."""
    g = torch.Generator().manual_seed(5)
    h = model.config.hidden_size
    with torch.no_grad():
        emb = model.embedding.word_embeddings.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())  # unit RMS rows: enorm(e) = e
        main = model.decoder.layers[0]
        main.self_attention.linear_proj.weight.mul_(attention)
        for layer in model.mtp.layers:
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
            layer.mtp_model_layer.load_state_dict(main.state_dict())
            layer.final_layernorm.load_state_dict(model.decoder.final_layernorm.state_dict())
            for p in layer.mtp_model_layer.mlp.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return model


def _run(model, k, prompts, n=16):
    engine = Engine(model, VOCAB, num_speculative_tokens=k)
    reqs = [Request(p, SamplingParams(max_new_tokens=n, logprobs=True)) for p in prompts]
    return engine.generate(reqs), engine.acceptance


@pytest.mark.parametrize("case", ["rejected", "accepted"])
def test_speculative_greedy_equals_plain(case):
    model = mtp_model() if case == "rejected" else bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7)
    plain = Engine(model, VOCAB).generate([Request(p, SamplingParams(max_new_tokens=16, logprobs=True))
                                           for p in PROMPTS])
    drafted = accepted = 0
    for k, rows in ((1, [0, 1, 2]), (2, [0, 1, 2]), (2, [1])):
        results, stats = _run(model, k, [PROMPTS[i] for i in rows])
        for i, got in zip(rows, results):
            assert got.tokens == plain[i].tokens
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(plain[i].logprobs), atol=1e-5)
            assert got.prompt_logprobs[1:] == pytest.approx(plain[i].prompt_logprobs[1:], abs=1e-5)
        assert stats.drafted > 0
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        if case == "rejected":
            assert stats.accepted == 0 and stats.tokens_per_step == 1
        else:  # several tokens kept per verification pass
            assert stats.rate > 0.4 and stats.tokens_per_step > 1.5, stats
    if case == "accepted":  # and some drafts rejected: both paths of the rule taken
        assert 0 < accepted < drafted


@pytest.mark.parametrize("case", ["rejected", "accepted"])
def test_steps_run_ahead_of_the_host_give_plain_greedy_tokens(case):
    """Without log-probabilities, callbacks or stop strings, greedy speculative steps run in chunks with their counts on
    the device (read once a chunk): the tokens still equal plain greedy decoding's, rows of several lengths and budgets
    (the longest row's budget and the cache bound the chunks), the end-of-document token stopping a row included."""
    model = mtp_model() if case == "rejected" else bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7)
    budgets = [23, 9, 17]
    reqs = [Request(p, SamplingParams(max_new_tokens=b)) for p, b in zip(PROMPTS, budgets)]
    plain = Engine(model, VOCAB).generate(reqs)
    for k in (1, 2):
        engine = Engine(model, VOCAB, num_speculative_tokens=k)
        got = engine.generate(reqs)
        assert [r.tokens for r in got] == [r.tokens for r in plain]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in plain]
        assert engine.acceptance.ahead > 0 and engine.acceptance.drafted > 0
        if case == "accepted":
            assert engine.acceptance.tokens_per_step > 1.5, engine.acceptance
        single = Engine(model, VOCAB, num_speculative_tokens=k)
        assert single.generate([reqs[0]])[0].tokens == plain[0].tokens
        ahead = single.acceptance
        synced = Engine(model, VOCAB, num_speculative_tokens=k)  # log-probabilities: one host read per step
        synced.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=budgets[0], logprobs=True))])
        counts = lambda a: (a.drafted, a.accepted, a.steps, a.tokens)  # noqa: E731
        assert synced.acceptance.ahead == 0 and counts(ahead) == counts(synced.acceptance)  # the same drafts
        windows = []  # and the same hidden states left for the depths to draft from
        for logprobs in (False, True):
            run = SpeculativeRun(Engine(model, VOCAB, num_speculative_tokens=k),
                                 [Request(PROMPTS[0], SamplingParams(max_new_tokens=budgets[0], logprobs=logprobs))])
            run.prefill()
            run.decode(None)
            windows.append((run.window, run.start))
        assert torch.equal(windows[0][0], windows[1][0]) and windows[0][1] == windows[1][1]
    eod = plain[0].tokens[5]  # a token the first row generates: as the end-of-document token it stops that row there
    want = Engine(model, VOCAB, eod=eod).generate(reqs)
    got = Engine(model, VOCAB, eod=eod, num_speculative_tokens=2).generate(reqs)
    assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in want]
    assert want[0].finish_reason == "stop"


def test_speculative_sampling_is_seeded_and_stops():
    model = bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7)
    engine = Engine(model, VOCAB, num_speculative_tokens=2)
    sp = SamplingParams(max_new_tokens=11, temperature=0.8, top_k=20, seed=3)
    a = engine.generate([Request(PROMPTS[0], sp), Request(PROMPTS[1], SamplingParams(max_new_tokens=5))])
    b = engine.generate([Request(PROMPTS[0], sp), Request(PROMPTS[1], SamplingParams(max_new_tokens=5))])
    assert a[0].tokens == b[0].tokens and len(a[0].tokens) == 11 and len(a[1].tokens) == 5
    plain = Engine(model, VOCAB).generate([Request(PROMPTS[1], SamplingParams(max_new_tokens=5))])[0]
    assert a[1].tokens == plain.tokens
    greedy = Engine(model, VOCAB).generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=10))])[0].tokens
    eod, detok = greedy[4], (lambda ids: "".join(f"<{i}>" for i in ids))  # noqa: E731
    for kw, sp in ((dict(eod=eod), SamplingParams(max_new_tokens=10)),  # stops at the end-of-document token
                   (dict(detokenize=detok), SamplingParams(max_new_tokens=10, stop=(f"<{greedy[3]}>",)))):
        want = Engine(model, VOCAB, **kw).generate([Request(PROMPTS[0], sp)])[0]
        got = Engine(model, VOCAB, num_speculative_tokens=2, **kw).generate([Request(PROMPTS[0], sp)])[0]
        assert (got.tokens, got.finish_reason, got.text) == (want.tokens, "stop", want.text)
        assert len(got.tokens) < 10


class _Enumerating:
    """A sampler whose uniform draws are given and whose draws record their weights (so the distribution of the
    drawn token is known exactly instead of sampled)."""
    greedy = False

    def __init__(self, u: torch.Tensor):
        self.u, self.is_greedy, self.weights = u, torch.zeros(len(u), dtype=torch.bool), None

    def probs(self, logits):
        return torch.softmax(logits.double(), -1)

    def uniform(self, n):
        return self.u[:, :n]

    def draw(self, weights):
        self.weights = weights / weights.sum(-1, keepdim=True)
        return weights.argmax(-1)


def test_rejection_rule_output_distribution_is_the_targets_exactly():
    """Two drafts over a vocabulary of 4: every draft pair (weighted by q) and a grid of 40 x 40 uniform draws (the
    acceptance ratios are multiples of 1/40, so the grid's acceptance frequencies are exact). The first kept token
    has distribution p_0; given d_1 accepted, the second has p_1; given both, the bonus token p_2."""
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.3, 0.1, 0.2, 0.4], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.25, 0.5, 0.25, 0.0]], dtype=torch.float64)
    n = 40
    d1, d2, i1, i2 = (t.reshape(-1) for t in torch.meshgrid(*map(torch.arange, (3, 3, n, n)), indexing="ij"))
    u1, u2 = (i1.double() + 0.5) / n, (i2.double() + 0.5) / n
    rows = len(d1)
    sampler = _Enumerating(torch.stack([u1, u2], 1))
    a, x = accept(sampler, p.log()[None].expand(rows, -1, -1), torch.stack([d1, d2], 1),
                  q[None].expand(rows, -1, -1))
    weight = q[0, d1] * q[1, d2] / n ** 2
    first = torch.zeros(4, dtype=torch.float64)  # P(first kept token = v)
    first.index_add_(0, d1[a >= 1], weight[a >= 1])
    first += (weight[a == 0, None] * sampler.weights[a == 0]).sum(0)
    assert torch.allclose(first, p[0], atol=1e-12)
    second = torch.zeros(4, dtype=torch.float64)  # given d_1 accepted
    second.index_add_(0, d2[a == 2], weight[a == 2])
    second += (weight[a == 1, None] * sampler.weights[a == 1]).sum(0)
    assert torch.allclose(second / weight[a >= 1].sum(), p[1], atol=1e-12)
    assert torch.allclose(sampler.weights[a == 2], p[2].expand(int((a == 2).sum()), -1))
    assert 0 < int((a == 0).sum()) and 0 < int((a == 1).sum()) and 0 < int((a == 2).sum())


def test_greedy_acceptance_is_exact_match():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]] * 3)
    drafts = torch.tensor([[1, 0], [1, 2], [0, 0]])

    class Greedy:
        greedy = True

    a, x = accept(Greedy(), logits, drafts, None)
    assert a.tolist() == [2, 1, 0] and x.tolist() == [2, 0, 1]


def test_speculative_flag_errors():
    with pytest.raises(ValueError, match="--mtp-num-layers"):
        Engine(GPTModel(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                                    max_position_embeddings=16).resolved(), 64), 64, num_speculative_tokens=1)
    with pytest.raises(ValueError, match="draft at most 2"):
        Engine(mtp_model(), VOCAB, num_speculative_tokens=3)



def test_generate_command_speculative(tmp_path, capsys):
    """``paratron generate --num-speculative-tokens`` on a checkpoint trained with --mtp-num-layers: the tokens of
    plain decoding, the flag and the acceptance on stderr; more drafts than depths refused in one line."""
    import json

    from paratron.cli import main
    from paratron.config import parse_args
    from paratron.train.loop import pretrain
    pretrain(parse_args(["--config", "tiny", "--train-iters", "1", "--eval-iters", "0", "--mtp-num-layers", "1",
                         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                         "--global-batch-size", "1", "--save", str(tmp_path)]))
    capsys.readouterr()  # the training log
    common = ["generate", "--load", str(tmp_path), "--prompt", "7 8 9", "--json", "--max-new-tokens", "6",
              "--ignore-eod"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(common + ["--num-speculative-tokens", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == plain["tokens"]
    assert "--num-speculative-tokens 1" in out.err and "drafted tokens accepted (rate" in out.err
    paged = ["--inference-dynamic-batching", "--inference-dynamic-batching-block-size", "4",
             "--inference-dynamic-batching-max-tokens", "4", "--enable-chunked-prefill"]
    assert main(common + paged + ["--num-speculative-tokens", "1"]) == 0  # the paged engine drafts too
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == plain["tokens"]
    assert "speculative decoding: up to 1 drafts" in out.err and "drafted tokens accepted (rate" in out.err
    for more in ([], paged):
        assert main(common + more + ["--num-speculative-tokens", "2"]) == 2
        assert "draft at most 1" in capsys.readouterr().err


def test_spec_decode_benchmark_runs_tiny_on_cpu(tmp_path, monkeypatch):
    import json
    import runpy
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_bench.py"
    monkeypatch.setattr("sys.argv", [str(script), "--tiny", "--repeats", "1", "--warmup", "0", "--new-tokens", "4",
                                     "--num-speculative-tokens", "1", "--record-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    record = next(tmp_path.glob("decode_bench_speculative_tiny_*.md")).read_text()
    rows = [json.loads(line) for line in record.split("```json\n")[1].split("```")[0].splitlines()]
    assert [r["system"] for r in rows] == ["plain", "speculative k=1"]
    assert rows[1]["same_tokens_as_plain"] == 1.0 and 0.0 <= rows[1]["acceptance"] <= 1.0
