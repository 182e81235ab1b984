"""FP8 linear layers (paratron/fp8/linear.py) at llama-1b's shapes: accuracy and speed.

    python benchmarks/fp8_check.py [--recipe tensorwise|delayed] [--format hybrid|e4m3] [--no-train]

(a) accuracy: for each transformer matmul of llama-1b (QKV, proj, fc1, fc2; 4 x 2048 tokens), the
    real FP8 path (torch._scaled_mm) and its emulation (dequantise + fp32 matmul) against the fp32
    matmul of the same bf16 inputs: relative error (Frobenius) of y, grad_input and grad_weight;
    real vs emulated should agree to accumulation rounding, both should sit at FP8's error.
(b) matmul speed: forward + backward of each layer, FP8 vs bf16 F.linear (CUDA events, GPU only).
(c) training throughput: paratron's Trainer.train_step on llama-1b at micro-batch 4, bf16 against
    `--fp8-format FORMAT --fp8-recipe RECIPE` (benchmarks/train_throughput.py's run_paratron; GPU
    only). The same variant from train_throughput.py:
    python benchmarks/train_throughput.py --config llama-1b --variant bf16: \\
        --variant "fp8:--fp8-format hybrid --fp8-recipe tensorwise"

On a machine without an FP8 GPU, (a) runs at shapes divided by 64 on the CPU (this torch runs
torch._scaled_mm there) and (b), (c) are skipped with a message. Writes a Markdown record to
--record-dir (default: $OUT if set, else benchmarks/results) when (b) or (c) ran.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from paratron import fp8  # noqa: E402

TOKENS = 4 * 2048
LAYERS = {"linear_qkv": (2048, (32 + 2 * 8) * 64), "linear_proj": (2048, 2048),
          "linear_fc1": (2048, 2 * 8192), "linear_fc2": (8192, 2048)}  # name: (in, out) at TP 1


def fp8_gpu() -> bool:
    return fp8.device_problem("cuda") is None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_linear(x, w, g, recipe):
    """y, grad_input, grad_weight of one FP8 linear call (fresh state) or of fp32 when recipe is None."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if recipe is None:
        y = x.float() @ w.float().t()
        y.backward(g.float())
    else:
        y = fp8.fp8_linear(x, w, fp8.FP8State(recipe))
        y.backward(g)
    return y, x.grad, w.grad


def inputs(m, k, n, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
    g = (torch.randn(m, n, generator=gen) * 1e-4).to(device, torch.bfloat16)
    return x, w, g


def accuracy(fmt: str, recipe: str, device: str, shrink: int) -> list[str]:
    lines = ["| layer | shape (m, k, n) | y real | y emulated | dx real | dx emulated | dW real | dW emulated "
             "| real vs emulated (max of y, dx, dW) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (k, n) in LAYERS.items():
        m, k, n = TOKENS // shrink, k // shrink, n // shrink
        x, w, g = inputs(m, k, n, device)
        ref = run_linear(x, w, g, None)
        real = run_linear(x, w, g, fp8.Recipe(fmt, recipe))
        emu = run_linear(x, w, g, fp8.Recipe(fmt, recipe, emulate=True))
        errs = [f"{rel(r, f):.4f}" for r, e, f in zip(real, emu, ref) for r in (r, e)]
        agree = max(rel(r, e) for r, e in zip(real, emu))
        lines.append(f"| {name} | ({m}, {k}, {n}) | " + " | ".join(errs) + f" | {agree:.2e} |")
    return lines


def matmul_speed(fmt: str, recipe: str) -> list[str]:
    from sdpa_check import bench as time_ms  # CUDA events: 3 warm-up calls, mean of 20
    lines = ["| layer | bf16 fwd+bwd ms | FP8 fwd+bwd ms | speed-up |", "|---|---|---|---|"]
    for name, (k, n) in LAYERS.items():
        x, w, g = inputs(TOKENS, k, n, "cuda")
        x.requires_grad_()
        w.requires_grad_()
        state = fp8.FP8State(fp8.Recipe(fmt, recipe), "cuda")
        bf16 = time_ms(lambda: F.linear(x, w).backward(g))
        f8 = time_ms(lambda: fp8.fp8_linear(x, w, state).backward(g))
        lines.append(f"| {name} | {bf16:.3f} | {f8:.3f} | {bf16 / f8:.2f}x |")
    return lines


def throughput(fmt: str, recipe: str, micro_batch: int, warmup: int, steps: int, extra: list[str]) -> list[str]:
    from train_throughput import run_paratron
    lines = ["| variant | flags | step ms | tokens/s | MFU % (bf16 peak) | peak GiB | loss |",
             "|---|---|---|---|---|---|---|"]
    base = ["--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch), *extra]
    for name, flags in (("bf16", []), ("fp8", ["--fp8-format", fmt, "--fp8-recipe", recipe])):
        r = run_paratron("llama-1b", base + flags, warmup, steps)
        lines.append(f"| {name} | `{' '.join(flags)}` | {r['step_ms']} | {r['tok_s']} | {r['mfu']} | "
                     f"{r['peak_mem_gb']} | {r['loss']} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="hybrid", choices=fp8.FORMATS)
    p.add_argument("--recipe", default="tensorwise", choices=fp8.RECIPES)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-train", action="store_true", help="skip (c), the training throughput")
    p.add_argument("--flags", default="", help="more flags for both (c) variants, e.g. '--torch-compile'")
    p.add_argument("--cpu", action="store_true", help="(a) only, on the CPU at small shapes, even on a GPU")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    gpu = fp8_gpu() and not args.cpu
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"torch {torch.__version__} on {device}; --fp8-format {args.format} --fp8-recipe {args.recipe}")
    sections = ["## (a) accuracy: relative error against the fp32 matmul of the same bf16 inputs", ""]
    sections += accuracy(args.format, args.recipe, "cuda" if gpu else "cpu", 1 if gpu else 64)
    print("\n".join(sections), flush=True)
    if not gpu:
        print(f"skipping (b) matmul speed and (c) training throughput: {fp8.device_problem('cuda') or '--cpu'}")
        return 0
    part = ["", "## (b) forward + backward of one layer, 4 x 2048 tokens", ""] + matmul_speed(args.format, args.recipe)
    print("\n".join(part), flush=True)
    sections += part
    if not args.no_train:
        sections += ["", f"## (c) llama-1b training step, micro-batch {args.micro_batch_size} {args.flags}", ""]
        sections += throughput(args.format, args.recipe, args.micro_batch_size, args.warmup, args.steps,
                               args.flags.split())
    from record import write_record
    path = write_record(args.record_dir, "fp8_check_llama-1b", "FP8 linear layers: accuracy and speed (llama-1b)",
                        device, {"recipe": f"--fp8-format {args.format} --fp8-recipe {args.recipe}",
                                 "method": f"CUDA events over 20 calls (b); {args.warmup} warm-up + {args.steps} "
                                           "timed steps of Trainer.train_step (c)"}, "\n".join(sections) + "\n")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
