#!/usr/bin/env python
"""Tensor-parallel generation on GPUs: the greedy tokens and the decode speed of TP 2 beside TP 1.

    python benchmarks/tp_decode_bench.py [--tp 1 2] [--batch 32] [--new-tokens 256]   # llama-1b shape, GPUs
    python benchmarks/tp_decode_bench.py --tiny                                         # CPU / gloo (the script)

One Hugging Face directory of random llama-1b weights (seed 0, fp32; ``paratron.checkpoint.hf.save_hf_dir``)
is loaded by every run the way ``paratron generate`` / ``serve`` load it: each rank converts it and keeps its
TP slices (``load_for_inference``), rank 0 leads the batches and the others follow (``runtime.Group``), as in
``torchrun --nproc-per-node N -m paratron serve``. Per TP size, one ``torchrun`` of this file in worker mode:

* equality: ``--prompts`` prompts of 128 random tokens, greedy, ``--check-tokens`` new tokens, in fp32 (so that a
  TP sum order cannot flip a near-tie of random weights), eager; rank 0 writes the tokens;
* speed: the same weights in bf16 with the compiled decode step (CUDA graph), decode tokens/s at each
  ``--batch`` and time to first token, measured as benchmarks/decode_bench.py does (medians of ``--repeats``
  generations of 1 and of ``--new-tokens`` tokens after warm-up; nothing reads the tokens while they run).

The table gives, per TP size, the prompts whose greedy tokens equal TP 1's and the speeds. Writes a record to
--record-dir (default $OUT, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_bench import measure  # noqa: E402  (benchmarks/decode_bench.py: the same timing)
from record import write_record  # noqa: E402


def model_flags(tiny: bool) -> list[str]:
    if tiny:  # sharp random weights: no greedy near-ties
        return ["--config", "tiny", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights", "--init-method-std", "0.3"]
    return ["--config", "llama-1b"]


def make_weights(out: Path, tiny: bool) -> None:
    """Random weights (seed 0) as a Hugging Face Llama directory."""
    from paratron.checkpoint.hf import save_hf_dir
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(model_flags(tiny) + ["--mock-data"])
    torch.manual_seed(0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    save_hf_dir(out, state, cfg.model, "llama", cfg.data.vocab_size)


def worker(args) -> None:
    from paratron.inference.engine import Engine, Request
    from paratron.inference.load import load_for_inference
    from paratron.inference.runtime import Group, start
    from paratron.inference.sampling import SamplingParams
    dims, device = start(args.device)
    result = {"tp": dims.tp}
    g = torch.Generator().manual_seed(1)
    for phase in ("equality", "speed"):
        loaded = load_for_inference(args.load, dims, device, "fp32" if phase == "equality" else "bf16")
        group = Group(Engine(loaded.model, loaded.vocab_size, eod=None, compile=phase == "speed"), dims)
        if dims.rank != 0:
            group.follow()
            continue
        vocab = loaded.vocab_size

        def run(prompts: torch.Tensor, n: int):
            return [r.tokens for r in group.generate([Request(p, SamplingParams(n)) for p in prompts.tolist()])]
        if phase == "equality":
            prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
            result["tokens"] = run(prompts, args.check_tokens)
        else:
            for b in args.batch:
                prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=g)
                result[f"batch {b}"] = measure(run, prompts, args.new_tokens, args.repeats, args.warmup, device)
        group.close()
        del loaded, group
    if dims.rank == 0:
        Path(args.result).write_text(json.dumps(result))


def launch(args, tp: int, weights: Path, result: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp), __file__,
           "--worker", "--load", str(weights), "--result", str(result), "--prompts", str(args.prompts),
           "--prompt-len", str(args.prompt_len), "--check-tokens", str(args.check_tokens),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--batch", *map(str, args.batch)] + (["--device", args.device] if args.device else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore"))
    if proc.returncode:
        print((proc.stdout + proc.stderr)[-3000:], flush=True)
        return {"tp": tp, "failed": proc.returncode}
    return json.loads(result.read_text())


def table(runs: list[dict], batches: list[int]) -> str:
    ref = runs[0].get("tokens")
    head = "| TP | greedy tokens equal to TP 1's | " + " | ".join(
        f"batch {b}: TTFT ms / decode tokens/s" for b in batches)
    lines = [head + " |", "|---" * (len(batches) + 2) + "|"]
    for r in runs:
        if "failed" in r:
            lines.append(f"| {r['tp']} | failed (exit {r['failed']}) |" + " |" * len(batches))
            continue
        same = sum(a == b for a, b in zip(r["tokens"], ref)) if ref else 0
        speed = " | ".join(f"{r[f'batch {b}']['ttft_ms']} / {r[f'batch {b}']['decode_tok_s']:,.0f}" for b in batches)
        lines.append(f"| {r['tp']} | {same} of {len(r['tokens'])} prompts | {speed} |")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU with gloo (checks the script)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes timed (default 1 32; tiny: 2)")
    p.add_argument("--prompts", type=int, default=32, help="prompts compared with TP 1's")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 8)")
    p.add_argument("--check-tokens", type=int, default=None, help="greedy tokens compared (default 64; tiny: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens of a timed generation (default 256; tiny: 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", help="cuda or cpu (default: cuda if there is one; tiny: cpu)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per TP size")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    tiny = args.tiny
    args.batch = args.batch or ([2] if tiny else [1, 32])
    args.prompt_len = args.prompt_len or (8 if tiny else 128)
    args.check_tokens = args.check_tokens or (8 if tiny else 64)
    args.new_tokens = args.new_tokens or (8 if tiny else 256)
    args.device = args.device or ("cpu" if tiny else None)
    if tiny:
        args.prompts = min(args.prompts, 4)
    return args


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights"
        make_weights(weights, args.tiny)
        runs = [launch(args, tp, weights, Path(tmp) / f"tp{tp}.json") for tp in args.tp]
    text = table(runs, args.batch)
    print("\n" + text, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    name = "tp_decode_" + ("tiny" if args.tiny else "llama-1b")
    write_record(args.record_dir, name, "Tensor-parallel generation: greedy tokens and decode speed against TP 1",
                 f"{max(args.tp)} x {device}", {"model": " ".join(model_flags(args.tiny))}, text)
    return 0 if all("failed" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
