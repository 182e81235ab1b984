"""FlashAttention-4's causal attention at llama-1b's training shape, timed alone, for whichever flash-attn-4 is on
the path (run once per installed stack to compare versions): forward, and forward + backward through its autograd
function, beside cuDNN's fused SDPA. Prints the versions and a table (ms, TFLOP/s on the causal work).

    python benchmarks/fa4_version_bench.py [--batch 16 --seq 2048 --heads 32 --groups 8 --dim 64]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import cuda_median_ms as _ms  # noqa: E402


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    a = p.parse_args()
    from flash_attn.cute.interface import flash_attn_func
    b, s, h, g, d = a.batch, a.seq, a.heads, a.groups, a.dim
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 4 * b * s * s * h * d / 2  # causal: half the scores

    def fa4():
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def fa4_both():
        fa4().backward(dout)

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    def sdpa_both():
        sdpa().backward(dout.transpose(1, 2))

    ref = sdpa().transpose(1, 2)
    err = ((fa4().float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash-attn-4 {_version('flash-attn-4')}, "
          f"nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}, quack-kernels {_version('quack-kernels')}; "
          f"[{b}, {s}, {h} / {g} heads, {d}] bf16 causal; FA4 vs SDPA relative difference {err:.1e}")
    print("| kernel | forward ms | TFLOP/s | forward + backward ms | backward TFLOP/s |\n|---|---|---|---|---|")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        rows = [("FlashAttention-4", fa4, fa4_both), ("cuDNN SDPA", sdpa, sdpa_both)]
        for name, f, fb in rows:
            with torch.no_grad():
                t_f = _ms(f)
            t_fb = _ms(fb)
            t_b = t_fb - t_f
            print(f"| {name} | {t_f:.3f} | {fwd_flops / t_f / 1e9:.0f} | {t_fb:.3f} "
                  f"| {2.5 * fwd_flops / t_b / 1e9:.0f} |")


if __name__ == "__main__":
    main()
