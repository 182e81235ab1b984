"""BERT-340M training throughput on one GPU: paratron's BertModel training step beside transformers'
``BertForPreTraining`` + ``torch.compile``, at the same batch and numerics (bf16 compute, fp32 master weights
and AdamW).

    python benchmarks/bert_throughput.py [--micro-batch-size 8] [--steps 20] [--warmup 5] [--no-hf]
    python benchmarks/bert_throughput.py --tiny      # a CPU check of the script (2 layers, hidden 64)

paratron: ``Trainer.train_step`` of ``--model bert`` (24 layers, hidden 1024, 16 heads, sequence 512, the
BERT vocabulary's 30,522 ids, ``--bf16``, ``--torch-compile``) on synthetic BertDataset-shaped batches (15 %
masked positions, a padded tail, sentence-order labels). transformers: the same shapes in fp32 parameters under
``torch.autocast(bfloat16)``, ``torch.compile`` of the model, fused AdamW. Both count the same FLOPs per token
(bidirectional attention, no causal discount): 6 x (12 L h^2 + h^2 + h V) + 12 L s h. The record has tokens/s,
TFLOP/s, MFU (989 TFLOP/s bf16 peak on H100/H200) and peak memory, written to $OUT or benchmarks/results.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.record import write_record  # noqa: E402

BERT_340M = dict(layers=24, hidden=1024, heads=16, seq=512, vocab=30522)
TINY = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def flops_per_token(m: dict) -> float:
    h, L, s, V = m["hidden"], m["layers"], m["seq"], m["vocab"]
    return 6 * (12 * L * h * h + h * h + h * V) + 12 * L * s * h


def batches(m: dict, mbs: int, n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = m["seq"]
        text = torch.randint(5, m["vocab"], (mbs, s), generator=g)
        real = torch.arange(s).expand(mbs, s) < torch.randint(s // 2, s + 1, (mbs, 1), generator=g)
        masked = (torch.rand(mbs, s, generator=g) < 0.15) & real
        out.append({"text": text * real, "types": (torch.arange(s) >= s // 2).long().expand(mbs, s) * real,
                    "labels": torch.where(masked, text, -1), "is_random": torch.randint(0, 2, (mbs,), generator=g),
                    "loss_mask": masked.long(), "padding_mask": real.long()})
    return out


def measure(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def run_paratron(m: dict, mbs: int, warmup: int, steps: int, tiny: bool) -> float:
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    flags = ["--model", "bert", "--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
             "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]), "--max-position-embeddings",
             str(m["seq"]), "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs), "--train-iters",
             str(warmup + steps + 1), "--lr", "1e-4", "--data-path", "unused", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(m["vocab"]), "--eval-iters", "0", "--log-interval", "1000000"]
    flags += [] if tiny else ["--bf16", "--torch-compile"]
    cfg = parse_args(flags)
    data = iter(batches(m, mbs, warmup + steps))
    trainer = Trainer(cfg, data=(data, None))
    dt = measure(trainer.train_step, warmup, steps)
    trainer.close()
    return dt


def run_hf(m: dict, mbs: int, warmup: int, steps: int, tiny: bool) -> float:
    import transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.BertConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], num_hidden_layers=m["layers"],
                                     num_attention_heads=m["heads"], intermediate_size=4 * m["hidden"],
                                     max_position_embeddings=m["seq"], attn_implementation="sdpa")
    model = transformers.BertForPreTraining(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    fwd = model if tiny else torch.compile(model)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(m, mbs, 1)]
    b = data[0]
    labels = torch.where(b["labels"] >= 0, b["labels"], -100)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not tiny):
            out = fwd(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"],
                      labels=labels, next_sentence_label=b["is_random"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return measure(step, warmup, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a CPU check: 2 layers, hidden 64, no bf16 / compile")
    args = p.parse_args()
    m = TINY if args.tiny else BERT_340M
    warmup, steps = (1, 2) if args.tiny else (args.warmup, args.steps)
    tokens, fpt = args.micro_batch_size * m["seq"], flops_per_token(m)
    rows = ["| system | step ms | tokens/s | TFLOP/s | MFU % | peak GB |", "|---|---|---|---|---|---|"]
    systems = [("paratron", run_paratron)] + ([] if args.no_hf else [("transformers + torch.compile", run_hf)])
    for name, fn in systems:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        dt = fn(m, args.micro_batch_size, warmup, steps, args.tiny)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")
        tflops = tokens * fpt / dt / 1e12
        rows.append(f"| {name} | {dt * 1e3:.1f} | {tokens / dt:.0f} | {tflops:.1f} | {100 * tflops / 989:.1f} | "
                    f"{peak:.1f} |")
        print(rows[-1], flush=True)
        gc.collect()
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    write_record(os.environ.get("OUT") or ROOT / "benchmarks" / "results", "bert_throughput" + ("_tiny" if args.tiny
                 else "_340m"), "BERT training throughput: paratron beside transformers + torch.compile", hardware,
                 {"model": str(m), "micro batch": str(args.micro_batch_size)}, "\n".join(rows))


if __name__ == "__main__":
    main()
