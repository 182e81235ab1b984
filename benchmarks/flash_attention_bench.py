"""Causal attention forward and forward + backward at the benchmark models' shapes: torch SDPA (its
default kernel: cuDNN's on an H100) against FlashAttention-4 (paratron/model/flash_attention.py), both
on paratron's sequence-first layout, with TFLOP/s of the causal work. Writes a record.

    python benchmarks/flash_attention_bench.py        (on the device: . benchmarks/quack_env.sh first)
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import cuda_ms, write_record  # noqa: E402
from paratron.model import flash_attention  # noqa: E402

SHAPES = {"llama-1b": (16, 32, 8, 2048, 64), "gpt-350m": (16, 16, 16, 2048, 64),
          "llama-8b-like": (4, 32, 8, 4096, 128)}  # micro-batch, heads, kv heads, seq, head dim


def _sdpa(q, k, v):
    s, b, h, d = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                           is_causal=True, enable_gqa=h != k.size(2))
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _time(fn, q, k, v, dy):
    fwd = cuda_ms(lambda: fn(q, k, v))
    both = cuda_ms(lambda: torch.autograd.backward(fn(q, k, v), dy))
    return fwd, both


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    rows = ["| shape | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |", "|---|---|---|---|---|---|"]
    for name, (b, h, g, s, d) in SHAPES.items():
        q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(s, b, g, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        dy = torch.randn(s, b, h * d, device="cuda", dtype=torch.bfloat16)
        work = 2 * 2 * b * h * s * s * d / 2  # two matmuls, causal half
        for kernel, fn in (("SDPA (default)", _sdpa), ("FlashAttention-4", flash_attention.causal_attention)):
            try:
                fwd, both = _time(fn, q, k, v, dy)
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append(f"| {name} | {kernel} | failed: {str(e).splitlines()[0][:100]} | | | |")
                continue
            rows.append(f"| {name} (b{b} h{h} kv{g} s{s} d{d}) | {kernel} | {fwd:.3f} | {work / fwd / 1e9:.0f} | "
                        f"{both:.3f} | {3.5 * work / both / 1e9:.0f} |")
        print("\n".join(rows[-2:]), flush=True)
    body = "\n".join(rows) + "\n\nfwd+bwd TFLOP/s counts the backward as 2.5x the forward's matmul work.\n"
    write_record(args.record_dir, "flash_attention", "Causal attention: SDPA vs FlashAttention-4",
                 torch.cuda.get_device_name(), {"flash-attn-4": _version()}, body)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("flash-attn-4")
    except Exception:  # noqa: BLE001
        return "not installed"


if __name__ == "__main__":
    main()
