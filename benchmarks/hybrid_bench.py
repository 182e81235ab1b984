"""Hybrid stacks (Mamba-2 / Gated DeltaNet beside attention) on one GPU: the scan kernels against their
references, training throughput beside transformers' NemotronH, decode speed.

    python benchmarks/hybrid_bench.py kernels          # fla-core's chunked kernels vs the torch references
    python benchmarks/hybrid_bench.py train [--no-hf]  # hybrid-mini: paratron's Trainer vs NemotronH + compile
    python benchmarks/hybrid_bench.py decode           # hybrid-mini decode tokens/s at batch 1 and 32
    python benchmarks/hybrid_bench.py all --tiny       # every part on a tiny model on the CPU (checks the script)

kernels: forward and backward of Mamba-2's SSD and the gated delta rule at hybrid-mini's / Qwen3-Next's head
shapes, ``--kernel-linear-scan fla`` (kernels/linear_scan.py) against ``torch`` (the chunked references), with
packed documents; the largest relative difference of the outputs and gradients beside the times (CUDA events,
median). train: paratron's real training step (benchmarks/train_throughput.py run_paratron: Trainer, bf16,
fp32 master weights) on configs/hybrid-mini.yaml, and the same shape and batch as transformers'
NemotronHForCausalLM (its own Mamba-2 path as installed) in bf16 under torch.compile with torch's fused AdamW.
decode: paratron's engine (compiled decode step) as benchmarks/decode_bench.py measures it, beside NemotronH's
``generate``. Writes a record (record.py) per part to --record-dir (default $OUT, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from record import cuda_median_ms, write_record  # noqa: E402

TINY = ["--hybrid-layer-pattern", "M*-M", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size",
        "128", "--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size",
        "256", "--init-method-std", "0.3", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--position-embedding-type", "none", "--squared-relu"]


def scan_inputs(kind: str, b: int, s: int, device, docs: int = 4):
    """Random inputs of one scan at hybrid-mini's (ssd) or Qwen3-Next's (gdn) head shapes, ``docs`` packed
    documents per row."""
    from paratron.kernels.ssd import resets_of
    f = dict(device=device, dtype=torch.float32)
    ids = torch.arange(s, device=device)[None].expand(b, s) * docs // s
    if kind == "ssd":
        h, p, g, n = 64, 64, 8, 128
        x = dict(x=torch.randn(b, s, h, p, **f), dt=torch.nn.functional.softplus(torch.randn(b, s, h, **f) - 3),
                 A=-torch.rand(h, **f) * 8, B=torch.randn(b, s, g, n, **f), C=torch.randn(b, s, g, n, **f))
    else:
        h, d = 32, 128
        x = dict(q=torch.nn.functional.normalize(torch.randn(b, s, h, d, **f), dim=-1),
                 k=torch.nn.functional.normalize(torch.randn(b, s, h, d, **f), dim=-1), v=torch.randn(b, s, h, d, **f),
                 g=-torch.nn.functional.softplus(torch.randn(b, s, h, **f)), beta=torch.rand(b, s, h, **f))
    return x, resets_of(ids)


def kernels(args, device) -> str:
    from paratron.kernels.linear_scan import fla_available, gated_delta, ssd
    rows = ["| scan | kernel | batch x seq | fwd ms | fwd+bwd ms | max rel. diff vs torch |", "|---|---|---|---|---|---|"]
    b, s = (1, 64) if args.tiny else (4, 2048)
    kinds = ["torch"] + (["fla"] if fla_available(device) else [])
    for kind, fn in (("ssd", ssd), ("gdn", gated_delta)):
        x, reset = scan_inputs(kind, b, s, device)
        outs = {}
        for k in kinds:
            leaves = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}

            def fwd():
                return fn(**leaves, reset=reset, kernel=k)[0]

            def fwd_bwd():
                torch.autograd.grad(fwd().sum(), [t for t in leaves.values() if t.requires_grad])
            y = fwd()
            grads = torch.autograd.grad((y * y).sum(), [t for t in leaves.values() if t.requires_grad])
            outs[k] = [y.detach()] + [g_.detach() for g_ in grads]
            timing = (cuda_median_ms(fwd), cuda_median_ms(fwd_bwd)) if device.type == "cuda" else (None, None)
            diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(outs[k], outs["torch"]))
            rows.append(f"| {kind} | {k} | {b} x {s} | {timing[0]} | {timing[1]} | {diff:.2e} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def hf_nemotron(cfg, vocab, device, dtype):
    """transformers' NemotronHForCausalLM with paratron's config (random weights of its own init)."""
    import transformers

    from paratron.checkpoint.hf_config import hf_config_from_model_config
    hf_cfg = hf_config_from_model_config(cfg.model, vocab, "nemotron_h")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "torch_dtype"})
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def hf_train(cfg, vocab, device, dtype, warmup: int, steps: int) -> dict:
    model = hf_nemotron(cfg, vocab, device, dtype).train()
    step_model = torch.compile(model) if device.type == "cuda" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    ids = torch.randint(0, vocab, (b, s + 1), device=device)

    def step():
        loss = step_model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return dict(step_ms=round(dt * 1e3, 1), tok_s=round(b * s / dt))


def train(args, device) -> str:
    from paratron.config import parse_args
    from train_throughput import run_paratron
    preset, flags = ("tiny", TINY + ["--mock-data"]) if args.tiny else ("hybrid-mini", [])
    extra = flags + (["--device", "cpu", "--bf16", "false"] if device.type == "cpu" else [])
    rows = ["| system | step ms | tokens/s | TFLOP/s | MFU % | vs HF+compile |", "|---|---|---|---|---|---|"]
    ours = run_paratron(preset, extra, args.warmup, args.steps)
    hf = None
    if not args.no_hf:
        cfg = parse_args(["--config", preset, *extra])
        hf = hf_train(cfg, cfg.data.vocab_size, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                      args.warmup, args.steps)
        rows.append(f"| transformers NemotronH + compile | {hf['step_ms']} | {hf['tok_s']} | | | 1.00 |")
    ratio = f"{ours['tok_s'] / hf['tok_s']:.2f}" if hf else ""
    rows.insert(2, f"| paratron | {ours['step_ms']} | {ours['tok_s']} | {ours['tflops']} | {ours['mfu']} | {ratio} |")
    print("\n".join(rows), flush=True)
    return "\n".join(rows)


def decode(args, device) -> str:
    from decode_bench import measure, paratron_runner
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    preset, flags = ("tiny", TINY + ["--mock-data"]) if args.tiny else ("hybrid-mini", [])
    cfg = parse_args(["--config", preset, *flags])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size, device=device, dtype=dtype).eval()
    run = paratron_runner(model, cfg.data.vocab_size, compile_=device.type == "cuda")
    plen, n = (8, 8) if args.tiny else (128, 256)
    rows = ["| batch | time to first token ms | decode tokens/s | ms per token |", "|---|---|---|---|"]
    for b in (1, 32):
        prompts = torch.randint(0, cfg.data.vocab_size, (b, plen)).to(device)
        r = measure(run, prompts, n, args.repeats, 1, device)
        rows.append(f"| {b} | {r['ttft_ms']} | {r['decode_tok_s']} | {r['per_token_ms']} |")
        print(json.dumps(dict(batch=b, **r)), flush=True)
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("kernels", "train", "decode", "all"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script)")
    p.add_argument("--no-hf", action="store_true", help="train: paratron only")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    parts = ("kernels", "train", "decode") if args.part == "all" else (args.part,)
    for part in parts:
        body = {"kernels": kernels, "train": train, "decode": decode}[part](args, device)
        if not args.tiny:
            write_record(args.record_dir, f"hybrid_{part}", f"Hybrid stacks: {part}", hardware,
                         {"shape": "hybrid-mini" if part != "kernels" else "hybrid-mini / Qwen3-Next heads"}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
