"""Speculative decoding from MTP depths: decode tokens/s beside plain decoding, same checkpoint, same process,
with the acceptance rate.

    python benchmarks/spec_decode_bench.py --load CKPT --num-speculative-tokens 1 --num-speculative-tokens 2
    python benchmarks/spec_decode_bench.py --tiny       # a random tiny model with 2 MTP depths on the CPU

``--load``: a checkpoint trained with ``--mtp-num-layers N`` (paratron's, or a Hugging Face directory); K <= N.
Prompts: ``--prompt-kind counting`` (default) continues (s, s + 1, s + 2, ...) mod vocab, the documents of
``--mock-data``, so a checkpoint trained on mock data is asked what it learned; ``random`` draws token ids.
Both systems run greedy and never stop early; timing as decode_bench.py (decode tokens/s = batch x (N - 1) /
(time of N tokens - time of 1 token), medians after warm-up), the engine compiled with CUDA graphs on GPU unless
``--no-compile``. Each speculative row records its acceptance (accepted / drafted over the timed generation),
tokens kept per verification pass, and whether its tokens equal plain decoding's (greedy: they must, up to
bf16 near-ties). Writes a record (record.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_bench import measure  # noqa: E402  (benchmarks/decode_bench.py: the same timing)
from record import write_record  # noqa: E402


def build(args, device, dtype):
    """(model, real vocabulary, name)."""
    if args.load:
        from paratron.inference.load import load_for_inference
        loaded = load_for_inference(args.load, device=device, dtype={torch.bfloat16: "bf16"}.get(dtype, "fp32"))
        return loaded.model, loaded.vocab_size, Path(args.load).name
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--config", "tiny", "--mock-data", "--normalization", "RMSNorm", "--swiglu",
                      "--position-embedding-type", "rope", "--mtp-num-layers", "2", "--init-method-std", "0.3"])
    torch.manual_seed(0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size, device=device, dtype=dtype).eval()
    return model, cfg.data.vocab_size, "tiny"


def runner(model, vocab: int, compile_: bool, k: int):
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    engine = Engine(model, vocab, eod=None, compile=compile_, num_speculative_tokens=k)

    def run(prompts: torch.Tensor, n: int):
        return [r.tokens for r in engine.generate([Request(p, SamplingParams(n)) for p in prompts.tolist()])]
    return engine, run


def prompts_of(kind: str, batch: int, length: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        return torch.randint(0, vocab, (batch, length), generator=g).to(device)
    starts = torch.randint(1, vocab, (batch, 1), generator=g)
    return ((starts + torch.arange(length)[None]) % vocab).to(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", help="a checkpoint trained with --mtp-num-layers")
    p.add_argument("--tiny", action="store_true", help="a random tiny model on the CPU (checks the script)")
    p.add_argument("--num-speculative-tokens", type=int, action="append", help="K to measure (default 1 and 2)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-kind", choices=("counting", "random"), default="counting")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if not (args.load or args.tiny):
        p.error("give --load CKPT (trained with --mtp-num-layers) or --tiny")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_ = device.type == "cuda" and not args.no_compile
    plen, n = args.prompt_len or (8 if args.tiny else 128), args.new_tokens or (8 if args.tiny else 256)
    model, vocab, name = build(args, device, dtype)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {hardware}; {name}, batch {args.batch}, {args.prompt_kind} prompts of "
          f"{plen}, {n} new tokens, compile {compile_}", flush=True)
    prompts = prompts_of(args.prompt_kind, args.batch, plen, vocab, device)
    rows, plain_tokens = [], None
    for k in [0] + (args.num_speculative_tokens or [1, 2]):
        engine, run = runner(model, vocab, compile_, k)
        row = dict(system="plain" if k == 0 else f"speculative k={k}", batch=args.batch,
                   **measure(run, prompts, n, args.repeats, args.warmup, device))
        tokens = run(prompts, n)
        if k == 0:
            plain_tokens = tokens
        else:
            s = engine.acceptance
            same = sum(x == y for a, b in zip(tokens, plain_tokens) for x, y in zip(a, b))
            row.update(acceptance=round(s.rate, 4), tokens_per_pass=round(s.tokens_per_step, 3),
                       same_tokens_as_plain=round(same / max(sum(map(len, plain_tokens)), 1), 3),
                       speedup=round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return report(rows, args, name, hardware, plen, n, compile_)


def report(rows, args, name, hardware, plen, n, compile_) -> int:
    lines = ["| system | batch | decode tokens/s | speedup | acceptance | tokens per pass | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['batch']} | {r['decode_tok_s']} | {r.get('speedup', '')} | "
                     f"{r.get('acceptance', '')} | {r.get('tokens_per_pass', '')} | {r.get('same_tokens_as_plain', '')} |")
    table = "\n".join(lines)
    print("\n" + table)
    body = table + "\n\n```json\n" + "\n".join(json.dumps(r) for r in rows) + "\n```\n"
    write_record(args.record_dir, f"spec_decode_bench_{name}", f"Speculative decoding: {name}", hardware,
                 {"shape": f"batch {args.batch}, {args.prompt_kind} prompts of {plen} tokens, {n} new tokens, greedy",
                  "method": f"median of {args.repeats} after {args.warmup} warm-up runs; compile {compile_}"},
                 body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
