"""The output layer's cross-entropy passes at llama-1b's shape, timed alone on the GPU: the compiled statistics
+ overwrite passes against the one-pass Triton kernel of paratron/parallel/cross_entropy.py per (block, warps),
with libdevice's exp and with the GPU's approximate exp, and the backward's per-token scaling (fp32 multiply +
cast against the row-scaling kernel). Prints a table.

    python benchmarks/ce_kernel_bench.py [--tokens 32768 --vocab 32768]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import cuda_ms  # noqa: E402
from paratron.parallel import cross_entropy as ce  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    a = p.parse_args()
    n, v = a.tokens, a.vocab
    logits = (torch.randn(n, v, device="cuda") * 3).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda")
    work = logits.clone()
    stats, grad_ = ce._kernel(ce._ce_stats, logits), ce._kernel(ce._ce_grad_, logits)

    def two_pass():
        work.copy_(logits)  # (timed separately below and subtracted)
        m, s, t = stats(work, target, v)
        grad_(work, m.float() + s.float().log(), target, v)

    copy_ms = cuda_ms(lambda: work.copy_(logits))
    gb = 2 * n * v * 2 / 1e9  # the logits read once and written once
    rows = [("compiled stats + overwrite (two passes)", cuda_ms(two_pass) - copy_ms)]
    for fast in (False, True):  # libdevice's exp / the GPU's approximate exp
        for block, warps in ((4096, 8), (2048, 4), (8192, 8), (8192, 16), (4096, 16), (4096, 4), (16384, 16)):
            def one_pass(block=block, warps=warps, fast=fast):
                work.copy_(logits)
                ce.fused_ce_(work, target, 0, block, warps, fast=fast)
            rows.append((f"fused_ce_ block {block} warps {warps}{', fast exp' if fast else ''}",
                         cuda_ms(one_pass) - copy_ms))
    print(f"{torch.cuda.get_device_name()}; logits {n} x {v} bf16 (copy {copy_ms:.3f} ms subtracted)")
    print("| pass | ms | TB/s (one read + one write) |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {gb / ms:.2f} |")
    x = torch.randn(n, a.hidden, device="cuda").bfloat16()
    g = torch.rand(n, 1, device="cuda")
    out = torch.empty_like(x)
    print(f"| x * g then cast (torch, fp32 temporary) | {cuda_ms(lambda: (x * g).to(x.dtype)):.3f} | |")
    for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
        ms = cuda_ms(lambda block=block, warps=warps: ce.scale_rows(x, g, out, block, warps))
        print(f"| scale_rows block {block} warps {warps} | {ms:.3f} | {2 * x.numel() * 2 / 1e9 / ms:.2f} |")


if __name__ == "__main__":
    main()
