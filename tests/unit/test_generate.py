"""Generation: greedy output of converted HF checkpoints (GPT-2, Llama, Mixtral, Qwen3-MoE) equals
transformers' token for token; KV-cache decode equals recomputing the whole prefix; seeded sampling is
reproducible; stops; the tokenizer travels with checkpoints and HF exports; `paratron generate` prints
text and JSON; --sample-prompt; the decode benchmark runs."""
from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.convert import from_hf, to_hf  # noqa: E402
from paratron.checkpoint.tokenizer_files import load_tokenizer  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.load import load_for_inference  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402

VOCAB = 100
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42]]  # different lengths: left padding


def hf_models():
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                     bos_token_id=0, eos_token_id=0)
    moe = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0)
    auto = transformers.AutoModelForCausalLM.from_config
    return {"gpt2": (transformers.GPT2LMHeadModel, gpt2), "llama": (transformers.LlamaForCausalLM, llama),
            "mixtral": (auto, transformers.AutoConfig.for_model("mixtral", num_local_experts=4, **moe)),
            "qwen3_moe": (auto, transformers.AutoConfig.for_model("qwen3_moe", num_experts=4, moe_intermediate_size=48,
                                                                  norm_topk_prob=True, **moe))}


def sharpen(model, seed=0):
    """Larger random weights than the default init, so greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "emb" in name or "wte" in name or "wpe" in name
                                                             else p.shape[1] ** -0.5))


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral", "qwen3_moe"])
def test_greedy_equals_transformers(tmp_path, family):
    cls, cfg = hf_models()[family]
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    if family in ("gpt2", "llama"):
        sharpen(hf)
    else:
        randomize(hf)  # (transformers 5's fused expert tensors too)
    hf.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ckpt")
    refs = []
    for p in PROMPTS:
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        with torch.no_grad():  # log-probabilities of the prompt and the generated tokens
            lp = torch.log_softmax(hf(ref[None]).logits[0].float(), -1)
        refs.append((ref[len(p):].tolist(), lp[:-1].gather(-1, ref[1:, None])[:, 0]))
    for source in ("hf", "ckpt"):  # the HF directory itself, and the paratron checkpoint converted from it
        loaded = load_for_inference(tmp_path / source)
        results = Engine(loaded.model, loaded.vocab_size).generate(
            [Request(p, SamplingParams(max_new_tokens=12, logprobs=True)) for p in PROMPTS])
        for (tokens, logprobs), res in zip(refs, results):
            assert res.tokens == tokens, source
            assert torch.allclose(torch.tensor(res.prompt_logprobs[1:] + res.logprobs), logprobs, atol=1e-4), source


def tiny_model(style="llama"):
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                    hidden_dropout=0.0, attention_dropout=0.0)
    if style == "llama":
        m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
        m.group_query_attention, m.num_query_groups, m.disable_bias_linear = True, 2, True
    torch.manual_seed(0)
    model = GPTModel(m.resolved(), 128, seed=3).eval()
    sharpen(model, 1)
    return model


@pytest.mark.parametrize("style,rows", [("gpt", 3), ("llama", 3), ("llama", 1)])  # 1 row: matmul decode attention
def test_kv_cache_decode_equals_full_recompute(style, rows):
    """Each decode step's distribution (from the cache, left-padded batch) equals the one of the whole
    prefix run from scratch; greedy rows pick its argmax, sampled rows walk off the greedy path."""
    model = tiny_model(style)
    steps = []
    params = [SamplingParams(max_new_tokens=10, logprobs=True, temperature=t, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.0))][:rows]
    results = Engine(model, VOCAB).generate([Request(p, sp) for p, sp in zip(PROMPTS, params)], on_step=steps.append)
    assert len(steps) == 10 and len(results) == rows
    for p, sp, r in zip(PROMPTS, params, results):
        seq = torch.tensor([p + r.tokens])
        with torch.no_grad():
            lp = torch.log_softmax(model(seq)[0, :, :VOCAB], -1)
        want = lp[len(p) - 1:-1].gather(-1, seq[0, len(p):, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-5)
        assert torch.allclose(torch.tensor(r.prompt_logprobs[1:]), lp[:len(p) - 1].gather(-1, seq[0, 1:len(p), None])[:, 0],
                              atol=1e-5)
        if sp.temperature == 0:
            assert r.tokens == lp[len(p) - 1:-1].argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    engine = Engine(tiny_model(), VOCAB)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    alone = engine.generate([Request(PROMPTS[0], sp)])[0].tokens
    again = engine.generate([Request(PROMPTS[0], sp)])[0].tokens
    others = [Request(PROMPTS[1], SamplingParams(max_new_tokens=20, temperature=1.0)), Request(PROMPTS[0], sp)]
    in_batch = engine.generate(others)[1].tokens
    other_seed = engine.generate([Request(PROMPTS[0], SamplingParams(**{**sp.__dict__, "seed": 8}))])[0].tokens
    assert alone == again == in_batch
    assert alone != other_seed
    greedy = engine.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=12))])[0].tokens
    top1 = engine.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1))])[0]
    assert top1.tokens == greedy


def test_stops_at_eod_max_tokens_and_stop_strings():
    model = tiny_model()
    greedy = Engine(model, VOCAB).generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=8))])[0].tokens
    eod = greedy[3]
    first = greedy.index(eod)
    res = Engine(model, VOCAB, eod=eod).generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=8))])[0]
    assert res.tokens == greedy[:first] and res.finish_reason == "stop"
    text = Engine(model, VOCAB, eod=eod).generate(
        [Request(PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eod=True))])[0]
    assert text.tokens == greedy and text.finish_reason == "length"
    detok = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    j = greedy.index(greedy[2])  # the first time the text shows "<greedy[2]>"
    res = Engine(model, VOCAB, detokenize=detok).generate(
        [Request(PROMPTS[0], SamplingParams(max_new_tokens=8, stop=(f"<{greedy[2]}>",)))])[0]
    assert res.finish_reason == "stop" and res.tokens == greedy[:j + 1] and res.text == detok(greedy[:j])
    engine = Engine(model, VOCAB)
    assert "context" in engine.check(Request(list(range(64)), SamplingParams()))
    assert engine.check(Request([1], SamplingParams(max_new_tokens=-1))).startswith("max_new_tokens")
    long = engine.generate([Request(list(range(1, 60)), SamplingParams(max_new_tokens=30))])[0]
    assert len(long.tokens) == 5 and long.finish_reason == "length"  # clipped at the context (64)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(d)
    return d


def test_tokenizer_travels_with_checkpoint_and_export(tiny_checkpoint):
    d = tiny_checkpoint
    tok = load_tokenizer(d / "ckpt")
    assert tok is not None and tok.detokenize(tok.tokenize("hello world")) == "hello world"
    to_hf(d / "ckpt", d / "exported")
    assert (d / "exported" / "tokenizer.json").is_file()
    assert load_tokenizer(d / "exported").tokenize("the lazy dog") == tok.tokenize("the lazy dog")
    assert json.loads((d / "exported" / "config.json").read_text())["eos_token_id"] == tok.eod


def test_generate_command(tiny_checkpoint, capsys, tmp_path):
    from paratron.cli import main
    d = tiny_checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps("the quick") + "\n")
    assert main(["generate", "--load", str(d / "ckpt"), "--prompts-file", str(prompts), "--json",
                 "--max-new-tokens", "5", "--ignore-eod"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    loaded = load_for_inference(d / "ckpt")
    engine = Engine(loaded.model, loaded.vocab_size, detokenize=loaded.tokenizer.detokenize)
    for row in rows:
        want = engine.generate([Request(loaded.tokenizer.tokenize(row["prompt"]), SamplingParams(5))])[0]
        assert row["tokens"] == want.tokens and row["text"] == want.text
    assert main(["generate", "--load", str(d / "ckpt"), "--prompt", "hello", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("hello")
    assert main(["generate", "--load", str(d / "ckpt"), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert main(["generate", "--load", str(d / "nothing"), "--prompt", "x"]) == 2


def test_sample_prompt_prints_the_trained_models_greedy_continuation(capsys):
    from paratron.config import parse_args
    from paratron.train.loop import pretrain
    cfg = parse_args(["--config", "tiny", "--train-iters", "2", "--eval-iters", "0", "--sample-prompt", "7 8 9",
                      "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "2"])  # context 32: the sample stops there (29 new tokens)
    result = pretrain(cfg)
    model, tok = result["trainer"].models[0].module, result["trainer"].tokenizer
    ids = tok.tokenize("7 8 9")
    with torch.no_grad():  # greedy by recomputing the whole prefix each step, no cache
        while len(ids) < 32:
            nxt = int(model(torch.tensor([ids]))[0, -1, :cfg.data.vocab_size].argmax())
            if nxt == tok.eod:
                break
            ids.append(nxt)
    assert result["sample"] == tok.detokenize(ids[3:]) and len(ids) > 10
    assert f" sample: {'7 8 9' + result['sample']!r}" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # qwen2: the qkv bias, qwen3: query / key norms
def test_decode_benchmark_runs_tiny_on_cpu(tmp_path, monkeypatch, capsys, family):
    import runpy
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_bench.py"
    monkeypatch.setattr("sys.argv", [str(script), "--tiny", "--repeats", "1", "--warmup", "0", "--new-tokens", "4",
                                     "--record-dir", str(tmp_path), "--family", family])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    record = next(tmp_path.glob("decode_bench_tiny_*.md")).read_text()
    rows = [json.loads(line) for line in record.split("```json\n")[1].split("```")[0].splitlines()]
    assert {(r["system"], r["batch"]) for r in rows} == {(s, b) for s in ("paratron", "hf-static") for b in (1, 32)}
    # same weights: the same tokens (qwen3's tiny model, its attention logits normalised by the query / key norms,
    # has greedy near-ties a batch of 32 decodes either way: its batch-1 row, the fused path, must agree)
    for r in rows:
        if r["system"] == "hf-static":
            assert r["same_tokens_as_paratron"] >= (0.9 if family == "qwen3" and r["batch"] > 1 else 1.0), r
    assert "| paratron | 32 |" in capsys.readouterr().out
    # the record says what the one-row steps ran: every layer of these Llama / Qwen2 / Qwen3 stacks takes the row path
    assert re.search(r"one-row steps: layers the row path takes: (\d+) of \1 .*--kernel-decode-gemv torch", record)


def test_decode_benchmark_counts_the_weights_a_step_streams():
    """The record's weights TB/s: every parameter once less the input embedding table when the output layer has its
    own weight; the rate is bytes x steps per second; the share of HBM only for the SXM parts the planner knows."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_bench.py"
    spec = importlib.util.spec_from_file_location("decode_bench_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for untie in (True, False):
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                          max_position_embeddings=16, untie_embeddings_and_output_weights=untie)
        model = GPTModel(cfg.resolved(), 128)
        everything = sum(p.numel() * p.element_size() for p in model.parameters())
        table = 128 * 32 * 4  # fp32
        assert bench.streamed_bytes(model) == (everything - table if untie else everything)
    assert bench.hbm_gbps("NVIDIA H200") == 4800.0 and bench.hbm_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.hbm_gbps("NVIDIA A100-SXM4-40GB") == 1555.0 and bench.hbm_gbps("NVIDIA A100-SXM4-80GB") == 2039.0
    assert bench.hbm_gbps("NVIDIA H100 PCIe") is None and bench.hbm_gbps("cpu") is None
    rows = [dict(system="paratron", batch=32, decode_tok_s=25600.0), dict(system="hf", batch=1, decode_tok_s=9.0)]
    bench.bandwidth(rows, 2_000_000_000, "NVIDIA H200")
    assert rows[0]["weights_gb"] == 2.0 and rows[0]["weights_tb_s"] == 1.6 and rows[0]["hbm_share"] == 0.333
    assert "weights_tb_s" not in rows[1]


def test_generate_command_on_the_paged_engine(tiny_checkpoint, capsys, tmp_path):
    """``paratron generate --inference-dynamic-batching``: every prompt into the paged engine at once (offline
    batches, RL rollouts), the answers in the prompts' order and equal to the fixed-batch engine's; the fixed
    engine's --batch-size is refused by name beside it."""
    from paratron.cli import main
    d = tiny_checkpoint
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nthe quick brown fox\nhello there\nover the lazy dog and\n")
    paged = ["--inference-dynamic-batching", "--inference-dynamic-batching-block-size", "4",
             "--inference-dynamic-batching-max-tokens", "8", "--enable-chunked-prefill"]
    common = ["generate", "--load", str(d / "ckpt"), "--prompts-file", str(prompts), "--json", "--max-new-tokens", "6",
              "--ignore-eod"]
    assert main(common) == 0
    fixed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(common + paged) == 0
    out = capsys.readouterr()
    assert [json.loads(line) for line in out.out.splitlines()] == fixed and "paged engine:" in out.err
    assert main(common + paged + ["--batch-size", "2"]) == 2
    assert "--batch-size is the fixed-batch engine's" in capsys.readouterr().err


def test_expert_parallel_size_must_divide_the_launch(tiny_checkpoint, capsys):
    from paratron.cli import main
    assert main(["generate", "--load", str(tiny_checkpoint / "ckpt"), "--prompt", "x",
                 "--expert-model-parallel-size", "2"]) == 2
    assert "--expert-model-parallel-size 2: must divide the 1 process(es)" in capsys.readouterr().err


class _GraphLikeRunner:
    """Stands in for graphs.DecodeRunner on CPU with a CUDA graph's output semantics: every call after the first
    writes its results into the tensors the first call returned and returns those (a replay's static outputs)."""

    def __init__(self, step, batch, device, switch="auto", pdl="auto"):
        self.step, self.out = step, None

    def __call__(self, tokens, slot):
        slot = slot if isinstance(slot, torch.Tensor) else torch.tensor(slot)
        fresh = self.step(tokens.clone(), slot.clone())
        if self.out is None:
            self.out = fresh
        else:
            for static, new in zip(self.out, fresh):
                static.copy_(new)
        return self.out


def test_greedy_tokens_survive_the_graphs_static_outputs(monkeypatch):
    """All-greedy rows take the compiled step's own argmax: the host reads the tokens only every few steps, so each
    step's tokens must not be the replay's output buffer, which the next replay overwrites."""
    from paratron.inference import graphs
    model = tiny_model()
    reqs = [Request(p, SamplingParams(max_new_tokens=20)) for p in PROMPTS[:3]]
    want = [r.tokens for r in Engine(model, VOCAB).generate(reqs)]
    assert any(len(set(t[1:6])) > 1 for t in want)  # tokens that change within the first read's steps
    monkeypatch.setattr(graphs, "DecodeRunner", _GraphLikeRunner)
    engine = Engine(model, VOCAB, compile=True)
    got = [r.tokens for r in engine.generate(reqs)]
    assert isinstance(engine.graph, _GraphLikeRunner)
    assert got == want
