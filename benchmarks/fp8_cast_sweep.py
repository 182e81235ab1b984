"""Tile configs and code variants of the FP8 cast kernels (paratron/parallel/fp8_mlp.py), each launched
directly (no autotuner), checked and timed on one GPU: how ``TILES`` and ``FAST_RCP`` there were chosen.

    python benchmarks/fp8_cast_sweep.py          # prints the table, writes a record ($OUT or benchmarks/results)

Cases (delayed recipe: a preset scale, the cast pass alone): the GeLU forward and backward with fc1's
bias at gpt-350m's MLP (micro-batch 32), SwiGLU's at llama-1b's (micro-batch 16), and the plain cast of
an output gradient (``paratron::cast_fp8``, e5m2) at the QKV and hidden widths. Each launch is checked:
FP8 bytes equal to the torch expressions but for rare one-step flips (< 1e-3 of them), the amax and the
bias gradient, and the transposed copy (the stored tile read back after a barrier) byte-equal to the
row-major one transposed. (Transposing the FP8 values computed in registers instead gave wrong bytes in
25-50 % of the copy under Triton 3.6 wherever the kernel loads two tensors: see fp8_mlp.py; the records of
2026-11-25/26 also time the separate one-byte transpose kernel used in between.) Rows for reference:
Inductor's compiled amax + cast + transpose of the same tensor, and a plain bf16 copy (bandwidth).
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.record import ROOT, cuda_ms, write_record  # noqa: E402
from paratron.parallel import fp8_mlp  # noqa: E402
from paratron.parallel.fp8 import E4M3, E5M2, FMAX  # noqa: E402

TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 4), (128, 128, 8), (32, 256, 4),
         (64, 256, 8), (256, 64, 8), (256, 128, 8), (128, 256, 8), (256, 128, 16))
CASES = (  # name, kind, rows, width, activation, bias
    ("gelu fwd gpt-350m", "fwd", 32 * 2048, 4096, fp8_mlp.GELU, True),
    ("gelu bwd gpt-350m", "bwd", 32 * 2048, 4096, fp8_mlp.GELU, True),
    ("swiglu fwd llama-1b", "fwd", 16 * 2048, 8192, fp8_mlp.SWIGLU, False),
    ("swiglu bwd llama-1b", "bwd", 16 * 2048, 8192, fp8_mlp.SWIGLU, False),
    ("cast qkv-grad gpt-350m", "cast", 32 * 2048, 3072, fp8_mlp.IDENTITY, False),
    ("cast hidden-grad gpt-350m", "cast", 32 * 2048, 1024, fp8_mlp.IDENTITY, False),
    ("cast qkv-grad llama-1b", "cast", 16 * 2048, 3072, fp8_mlp.IDENTITY, False),
)


def _check(got, want, label: str) -> str:
    """'' when the kernel's (q, amax) match the reference's, else what differs."""
    q, current = got
    rq, rcurrent = want
    bad = []
    flips = (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean().item()
    if flips > 1e-3:
        bad.append(f"{flips:.1e} bytes differ")
    if abs(current.item() / rcurrent.item() - 1) > 1e-5:
        bad.append("amax")
    return f"{label}: " + ", ".join(bad) if bad else ""


def sweep_case(kind: str, m: int, f: int, act: int, bias: bool):
    """Rows (config, ms, GB/s, problem) for every tile and variant of one case."""
    cols = 2 * f if act == fp8_mlp.SWIGLU else f
    torch.manual_seed(0)
    h = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if bias else None
    d = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    dtype = E5M2 if kind in ("bwd", "cast") else E4M3
    scale = torch.tensor(37.5 if kind != "cast" else 1000.0, device="cuda")
    if kind == "fwd":
        rq, _, _, rcur = fp8_mlp.act_fp8_reference(h, b, scale, act, 0)
    elif kind == "bwd":
        rq, _, _, rcur, rdb = fp8_mlp.grad_fp8_reference(h, b, d, scale, act, True, 0)
    else:
        rq, _, _, rcur = fp8_mlp._to_fp8(h.float(), scale, dtype, 0)
    width = f if kind == "fwd" else cols  # the forward writes the activation, the backward fc1's gradient
    q = torch.empty(m, width, dtype=dtype, device="cuda")
    qt = torch.empty(width, m, dtype=dtype, device="cuda")
    part = torch.zeros(fp8_mlp.triton.cdiv(m, 32) * fp8_mlp.triton.cdiv(f, 64), device="cuda")
    bb = h if b is None else b
    moved = (h.numel() * 2 + (d.numel() * 2 if kind == "bwd" else 0) + 2 * q.numel()) / 1e6  # q and its transpose
    variants = (False, True) if act == fp8_mlp.GELU else (fp8_mlp.FAST_RCP,)
    rows = []
    for bm, bf, warps in TILES:
        grid = (fp8_mlp.triton.cdiv(m, bm), fp8_mlp.triton.cdiv(f, bf))
        db = torch.zeros(grid[0] if bias else 0, cols, device="cuda")
        for rcp in variants:
            sw = dict(ACT=act, GATED=act == fp8_mlp.SWIGLU, HAS_BIAS=bias, RCP=rcp, BM=bm, BF=bf, num_warps=warps)
            if kind == "bwd":
                def launch():
                    fp8_mlp._grad_cast.fn[grid](h, bb, d, scale, q, qt, part, db, m, f, FMAX=FMAX[dtype], **sw)
            else:
                def launch():
                    fp8_mlp._act_cast.fn[grid](h, bb, scale, q, qt, part, m, f, FMAX=FMAX[dtype], **sw)
            label = f"{bm}x{bf} w{warps} rcp={int(rcp)}"
            try:
                part.zero_()
                qt.zero_()
                launch()
                torch.cuda.synchronize()
                problem = _check((q, part.amax()), (rq, rcur), label)
                if not problem:  # the transposed copy, byte-equal to the row-major one transposed
                    flips = (qt.view(torch.uint8) != q.view(torch.uint8).t()).float().mean().item()
                    problem = f"{label}: transposed copy, {flips:.1e} of bytes differ" if flips else ""
                if kind == "bwd" and bias and not problem:
                    if ((db.sum(0) - rdb).norm() / rdb.norm()).item() > 1e-5:
                        problem = f"{label}: bias gradient"
                ms = cuda_ms(launch, iters=20, warmup=2)
            except Exception as e:  # a config the GPU cannot run (shared memory, registers): note it, go on
                rows.append((label, float("nan"), 0.0, f"{type(e).__name__}: {str(e)[:80]}"))
                continue
            rows.append((label, ms, moved / ms, problem))
    return rows


def baselines(kind: str, m: int, f: int) -> list:
    """Inductor's amax + cast + transpose (plain casts only) and a bf16 copy of the input."""
    x = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    rows = [("bf16 copy (x.clone())", cuda_ms(lambda: x.clone()), x.numel() * 4 / 1e6, "")]
    if kind == "cast":
        scale = torch.tensor(1000.0, device="cuda")

        def cast(x, s):
            q = (x.float() * s).clamp(-FMAX[E5M2], FMAX[E5M2]).to(E5M2)
            return q, q.t().contiguous(), x.abs().amax().float()
        fn = torch.compile(cast)
        rows.append(("inductor amax + cast + transpose", cuda_ms(lambda: fn(x, scale)), x.numel() * 4 / 1e6, ""))
    return [(n, ms, mb / ms, p) for n, ms, mb, p in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--cases", default="", help="comma-separated substrings of the case names to run (default all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_cast_sweep.py needs a CUDA GPU (the Triton kernels)")
    wanted = [c for c in CASES if not args.cases or any(s in c[0] for s in args.cases.split(","))]
    out = ["| case | config | ms | GB/s | check |", "|---|---|---|---|---|"]
    best = ["| case | best cast config | ms | GB/s | autotuner's tiles best | ms |", "|---|---|---|---|---|---|"]
    for name, kind, m, f, act, bias in wanted:
        rows = sweep_case(kind, m, f, act, bias)
        for label, ms, gbs, problem in rows + baselines(kind, m, f):
            out.append(f"| {name} | {label} | {ms:.3f} | {gbs:.0f} | {problem or 'ok'} |")
        ok = [r for r in rows if not r[3] and r[1] == r[1]]
        if ok:
            top = min(ok, key=lambda r: r[1])
            current = [r for r in ok if r[0].endswith(f"rcp={int(fp8_mlp.FAST_RCP)}")
                       and tuple(int(v) for v in r[0].split()[0].split("x")) + (int(r[0].split()[1][1:]),)
                       in fp8_mlp.TILES]
            cur = min(current, key=lambda r: r[1]) if current else ("-", float("nan"))
            best.append(f"| {name} | {top[0]} | {top[1]:.3f} | {top[2]:.0f} | {cur[0]} | {cur[1]:.3f} |")
        else:
            best.append(f"| {name} | no launch passed its check | | | | |")
        print(best[-1], flush=True)
    table = "\n".join(best) + "\n\nEvery launch:\n\n" + "\n".join(out)
    print(table)
    write_record(args.record_dir, "fp8_cast_sweep", "FP8 cast kernels: tiles and variants",
                 torch.cuda.get_device_name(), {"method": "CUDA events, mean of 20 launches after 2 warm-up launches",
                                                "scale": "preset (delayed recipe): the cast pass alone"}, table)


if __name__ == "__main__":
    main()
