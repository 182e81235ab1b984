"""The embedded demo: train a small Llama-style model on the running Python's standard library.

Corpus (the stdlib's .py files) -> JSONL -> byte-level BPE (HF tokenizers) -> .bin/.idx -> train on
the GPU if there is one, else the CPU -> print samples and where the checkpoint, TensorBoard logs
and loss plot are. Nothing is downloaded. `paratron train` with no flags and `make demo` run this.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .config import Config
from .errors import ArgumentParser

DEMO_DIR = Path(os.environ.get("PARATRON_DEMO_DIR", "runs/demo"))
TIME_CAP_MIN = 3.5


def demo_config(workdir: Path, data_prefix: str, tokenizer_json: str, iters: int, on_gpu: bool) -> Config:
    cfg = Config()
    m, tr, op, d, lg, ck = cfg.model, cfg.train, cfg.optim, cfg.data, cfg.log, cfg.ckpt
    m.num_layers, m.hidden_size, m.num_attention_heads = (6, 384, 6) if on_gpu else (4, 192, 4)
    m.seq_length = 256 if on_gpu else 128
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, False
    m.hidden_dropout = m.attention_dropout = 0.0
    tr.micro_batch_size, tr.global_batch_size = (32, 32) if on_gpu else (16, 16)
    tr.train_iters = iters
    tr.eval_interval, tr.eval_iters = max(iters // 6, 1), 4
    tr.bf16 = on_gpu
    op.lr, op.min_lr, op.lr_decay_style, op.lr_warmup_iters = 3e-3, 3e-4, "cosine", max(iters // 20, 1)
    op.weight_decay, op.adam_beta2 = 0.1, 0.95
    d.data_path, d.split = [data_prefix], "95,5,0"
    d.tokenizer_type, d.tokenizer_model = "HuggingFaceTokenizer", tokenizer_json
    d.num_workers = 0  # the corpus is small and in memory maps; a worker would only compete for cores
    d.data_cache_path = str(workdir / "index-cache")
    lg.log_interval = log_interval(iters, on_gpu)
    tr.cpu_threads = None if on_gpu else demo_threads()
    tr.exit_duration_in_mins = TIME_CAP_MIN  # a slow machine still finishes within ~5 minutes (and says so)
    lg.tensorboard_dir = str(workdir / "tensorboard")
    lg.plot_path = str(workdir / "loss.png")
    ck.save = str(workdir / "checkpoints")
    from .train.resolve import resolve  # the run's resolve: it reads the tokenizer's vocabulary size
    return resolve(cfg)


def demo_threads() -> int:
    """Every core but one: on a 2-core machine shared with anything else, one thread trained 2-4x faster
    than two, and at most ~15 % slower on a quiet one (benchmarks/results/cpu_threads.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def log_interval(iters: int, on_gpu: bool) -> int:
    """About 20 log lines within the time cap: on a GPU the run ends well inside it (a line every
    iters / 12); a 2-core CPU does ~0.7 s an iteration (issue 48's runs), so every 10 iterations is a
    line every ~7 s, and still one a minute on a machine ten times slower."""
    return max(iters // 12, 1) if on_gpu else max(1, min(10, iters // 12))


def written(cfg: Config, result: dict) -> list[str]:
    """The 'what: where' lines of the files the run actually wrote (no plot without a logged loss)."""
    out = []
    if cfg.ckpt.save and Path(cfg.ckpt.save).is_dir() and any(Path(cfg.ckpt.save).glob("iter_*")):
        out.append(f"checkpoint:  {cfg.ckpt.save}")
    if cfg.log.tensorboard_dir and Path(cfg.log.tensorboard_dir).is_dir():
        out.append(f"tensorboard: {cfg.log.tensorboard_dir}  (tensorboard --logdir {cfg.log.tensorboard_dir})")
    if result.get("plot"):
        out.append(f"loss plot:   {result['plot']}")
    return out


def whole_lines(text: str, finish_reason: str) -> list[str]:
    """The lines of a sample, without the last one when generation cut it off."""
    lines = text.splitlines()
    return lines[:-1] if finish_reason == "length" and len(lines) > 1 else lines


def run_demo(argv: list[str]) -> int:
    p = ArgumentParser(prog="paratron demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=str(DEMO_DIR), help="where data, checkpoints and logs go (default %(default)s)")
    p.add_argument("--train-iters", type=int, default=None, help="default: 500 on CPU, 1500 on GPU")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="MB of stdlib source to train on")
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    from .data.corpus import prepare_demo_data
    from .inference.engine import Engine, Request
    from .inference.sampling import SamplingParams
    from .train.loop import pretrain

    workdir = Path(args.workdir)
    on_gpu = torch.cuda.is_available()
    iters = args.train_iters or (1500 if on_gpu else 500)
    t0 = time.time()
    print(f"paratron demo: preparing data in {workdir} (Python standard library source, "
          f"byte-level BPE of {args.vocab_size} tokens)", flush=True)
    prefix, tok_json = prepare_demo_data(workdir / "data", vocab_size=args.vocab_size,
                                         max_bytes=int(args.corpus_mb * 2**20))
    from .data.bpe_train import vocabulary_report
    print(f"paratron demo: data ready in {time.time() - t0:.0f} s (tokenizer: "
          f"{vocabulary_report(tok_json, args.vocab_size, 2)}); training on {'GPU' if on_gpu else 'CPU'} for {iters} "
          f"iterations (at most {TIME_CAP_MIN:g} minutes)", flush=True)
    cfg = demo_config(workdir, prefix, tok_json, iters, on_gpu)
    result = pretrain(cfg, eval_at_start=True)
    trainer = result["trainer"]
    curve = result["valid_curve"]
    tok = trainer.tokenizer
    model = trainer.model.module
    if result["iteration"] < iters:
        print(f"\nthe time cap stopped the demo after {result['iteration']} of its {iters} iterations "
              f"({result['exit_reason']}; --train-iters {result['iteration']} fits in it on this machine)")
    print("\nSamples from the trained model (temperature 0.7, top-k 20; whole lines):")
    engine = Engine(model, cfg.data.vocab_size, tok.eod, tok.detokenize)
    prompts = ("def", "import", "class")
    requests = [Request(tok.tokenize(p), SamplingParams(96, temperature=0.7, top_k=20, seed=i))
                for i, p in enumerate(prompts)]
    for prompt, res in zip(prompts, engine.generate(requests)):
        print("\n".join("  | " + line for line in whole_lines(prompt + res.text, res.finish_reason)[:8]) + "\n")
    if len(curve) >= 2:
        first, last = curve[0][1], curve[-1][1]
        print(f"\nvalidation loss {first:.3f} -> {last:.3f} ({100 * (first - last) / first:.0f} % lower)")
    print("\n".join(written(cfg, result) + [f"total time:  {time.time() - t0:.0f} s"]))
    return 0
