"""The AdamW kernel (paratron/optim/fused_adamw.py) on one fp32 master of llama-1b's fc1 size and a
1.1 B-element set of llama-1b's shapes, per (BLOCK, num_warps), timed alone on the GPU with the bytes it moves
(fp32 master, gradient and two moments read, master and moments written, the bf16 weight written: 30 bytes
per element). Prints a table.

    python benchmarks/adamw_kernel_bench.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import cuda_ms  # noqa: E402
from paratron.optim import fused_adamw  # noqa: E402

VARIANTS = [(4096, 8), (8192, 8), (8192, 16), (2048, 4), (4096, 4), (16384, 16)]


def main() -> None:
    h, f, v = 2048, 8192, 32768
    layer = [(3072, h), (h, h), (2 * f, h), (h, f), (h,), (h,)]
    shapes = layer * 16 + [(v, h), (v, h), (h,)]
    masters = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
    for m in masters:
        m.grad = torch.randn_like(m) * 1e-3
    outs = {m: torch.empty(m.shape, dtype=torch.bfloat16, device="cuda") for m in masters}
    adam = torch.optim.AdamW(masters, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    n = sum(m.numel() for m in masters)
    print(f"{torch.cuda.get_device_name()}; {n / 1e9:.2f} B elements in {len(masters)} masters")
    print("| BLOCK | warps | ms per step | TB/s |\n|---|---|---|---|")
    for block, warps in VARIANTS:
        fused_adamw.BLOCK, fused_adamw.NUM_WARPS = block, warps
        ms = cuda_ms(lambda: fused_adamw.adamw_step_(adam, outs), iters=10, warmup=2)
        print(f"| {block} | {warps} | {ms:.2f} | {30 * n / 1e9 / ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
