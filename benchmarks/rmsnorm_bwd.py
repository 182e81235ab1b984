"""RMSNorm backward on the GPU: paratron's Triton kernel (model/rmsnorm.py) against what Inductor
generates for the torch expression, at one layer's shape (default llama-1b: micro-batch 16 x 2048
tokens, hidden 2048, bf16). Times a compiled forward + backward of ``Norm`` (followed by a cast,
as the FP8 path consumes it) both ways, the forward alone, and the backward op alone with its
bandwidth (reads x and dy, writes dx: 3 x tokens x hidden x 2 bytes, plus the fp32 partial sums).

    python benchmarks/rmsnorm_bwd.py [--tokens 32768] [--hidden 2048] [--record-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from record import cuda_ms, write_record  # noqa: E402  (benchmarks/record.py)
from paratron.model.layers import Norm  # noqa: E402
from paratron.model.rmsnorm import launch_shape, rms_norm_backward_triton  # noqa: E402


def _timings(norm, x, dy):
    fwd = torch.compile(lambda t: norm(t).float())

    def step():
        x.grad = None
        norm.weight.grad = None
        fwd(x).backward(dy)

    def forward_only():
        fwd(x)
    return cuda_ms(step, iters=30, warmup=5), cuda_ms(forward_only, iters=30, warmup=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--record-dir", default=None)
    args = p.parse_args()
    n, h = args.tokens, args.hidden
    torch.manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(n, h, device="cuda", dtype=torch.float32)
    rows = []
    for label, triton_backward in (("Triton backward", True), ("Inductor (PARATRON_RMSNORM=torch)", False)):
        norm = Norm("RMSNorm", h, 1e-5, device="cuda", dtype=torch.bfloat16)
        norm.triton_backward = triton_backward
        torch._dynamo.reset()
        both, fwd = _timings(norm, x, dy)
        rows.append(f"| {label} | {both:.3f} | {fwd:.3f} | {both - fwd:.3f} |")
    xd, dyb = x.detach(), dy.to(torch.bfloat16)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    rstd = torch.rsqrt(xd.float().pow(2).mean(-1) + 1e-5)
    op_ms = cuda_ms(lambda: rms_norm_backward_triton(dyb, xd, w, rstd), iters=50, warmup=5)
    gbytes = 3 * n * h * 2 / 1e9
    body = "\n".join(["| path | forward + backward ms | forward ms | backward ms (difference) |", "|---|---|---|---|",
                      *rows, "", f"Backward op alone (bf16 dy): {op_ms:.3f} ms, {gbytes / op_ms * 1e3:.0f} GB/s "
                      f"of x, dy, dx traffic; tile {launch_shape(h)} (BLOCK_H, BLOCK_ROWS, warps)."])
    print(body)
    if args.record_dir:
        write_record(args.record_dir, "rmsnorm_bwd", f"RMSNorm backward, {n} tokens x {h}",
                     torch.cuda.get_device_name(), {"dtype": "bf16 x, fp32 output gradient in the compiled timings"},
                     body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
