"""The routed experts' grouped GEMMs of a preset, timed alone on one GPU: for fc1 and fc2 the forward, input
gradient and weight gradient in bf16 (``torch._grouped_mm``) and in each FP8 path from already quantised
operands (the GEMM kernels alone), then the whole FP8 experts' function (quantisation included) forward and
forward + backward against bf16's, per recipe. Rows are balanced over the experts (each expert's group
a multiple of 128 rows), as the router's aux loss aims for. Median of CUDA-event timings.

    python benchmarks/expert_gemms.py --config moe-mini --tokens 16384
    python benchmarks/expert_gemms.py --config llama-1b --tokens 32768 --dense   # dense linears, bf16 and FP8

Writes a record (benchmarks/record.py) to $OUT if set, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.matmul_shapes import time_ms  # noqa: E402


def expert_shapes(preset: str, tokens: int):
    """(experts, routed rows, [(name, in_features, out_features)]) of one MoE layer of ``preset``."""
    from paratron.config import parse_args
    m = parse_args(["--config", preset]).model
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    return m.num_experts, tokens * m.moe_router_topk, [("fc1", m.hidden_size, f * (2 if m.swiglu else 1)),
                                                      ("fc2", f, m.hidden_size)]


def recipes():
    from paratron.fp8.recipe import Recipe
    return [("tensorwise e4m3", Recipe(format="e4m3", grouped_gemm="scaled_grouped_mm")),
            ("tensorwise hybrid", Recipe(format="hybrid", grouped_gemm="scaled_grouped_mm")),
            ("tensorwise dequant", Recipe(format="e4m3", grouped_gemm="dequant")),
            ("blockwise dequant", Recipe(format="e4m3", recipe="blockwise")),
            ("blockwise triton", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="triton"))]


def kernel_cases(x, w, g, ends):
    """(label, fn, flops) of each GEMM kernel on operands quantised beforehand."""
    from paratron.fp8.experts import _transposed_blocks, _weight_blocks
    from paratron.fp8.recipe import FP8State, Recipe
    from paratron.kernels.fp8_block import quantize_tiles
    from paratron.kernels.fp8_grouped import grouped_forward, grouped_wgrad
    s, k = x.shape
    n, flops = w.shape[1], 2 * x.shape[0] * x.shape[1] * w.shape[1]
    wt = w.transpose(1, 2).contiguous()
    cases = [("bf16 forward", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), flops),
             ("bf16 input grad", lambda: torch._grouped_mm(g, w, offs=ends), flops),
             ("bf16 weight grad", lambda: torch._grouped_mm(g.t(), x, offs=ends), flops)]
    st = FP8State(Recipe(format="e4m3"), x.device)
    xq, xtq, sx = st.input.quantize_both(x)
    wq, sw = st.quantize("weight", w)
    gq, gtq, sg = st.quantize_grad(g)
    wtq = wq.transpose(1, 2).contiguous()
    for path in ("scaled_grouped_mm", "dequant"):
        cases += [(f"tensor {path} fwd", lambda p=path: grouped_forward(xq, sx, wq, sw, ends, "tensor", x.dtype, p),
                   flops),
                  (f"tensor {path} dgrad", lambda p=path: grouped_forward(gq, sg, wtq, sw, ends, "tensor", x.dtype, p),
                   flops),
                  (f"tensor {path} wgrad", lambda p=path: grouped_wgrad(gtq, sg, xtq, sx, ends, "tensor", x.dtype, p),
                   flops)]
    bx, bsx = quantize_tiles(x)
    bxt, bsxt = quantize_tiles(x.t())
    bg, bsg = quantize_tiles(g)
    bgt, bsgt = quantize_tiles(g.t())
    bw, bsw = _weight_blocks(w, 0)
    bwt, bswt = _transposed_blocks(bw, bsw)
    for path in ("triton", "dequant"):
        cases += [(f"block {path} fwd", lambda p=path: grouped_forward(bx, bsx, bw, bsw, ends, "block", x.dtype, p),
                   flops),
                  (f"block {path} dgrad", lambda p=path: grouped_forward(bg, bsg, bwt, bswt, ends, "block", x.dtype, p),
                   flops)]
    cases.append(("block dequant wgrad", lambda: grouped_wgrad(bgt, bsgt, bxt, bsxt, ends, "block", x.dtype,
                                                               "dequant"), flops))
    return cases


def quack_cases(x, w, g, ends, tuned: bool):
    """quack-kernels' variable-length GEMM (CuTe DSL; its FP8 operands K-major) on the same products: bf16 and
    FP8 with the tensorwise scales as one alpha."""
    from quack.gemm_interface import gemm
    from paratron.fp8.recipe import FP8State, Recipe
    flops, cu = 2 * x.shape[0] * x.shape[1] * w.shape[1], torch.cat([ends.new_zeros(1), ends])
    st = FP8State(Recipe(format="e4m3"), x.device)
    xq, xtq, sx = st.input.quantize_both(x)
    wq, sw = st.quantize("weight", w)
    gq, gtq, sg = st.quantize_grad(g)
    wtq, wt = wq.transpose(1, 2).contiguous(), w.transpose(1, 2).contiguous()
    a_fwd, a_dgrad, a_wgrad = (1 / (sx * sw)).float(), (1 / (sg * sw)).float(), (1 / (sg * sx)).float()
    t = "*" if tuned else ""
    return [(f"quack{t} bf16 fwd", lambda: gemm(x, w.transpose(1, 2), cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} bf16 dgrad", lambda: gemm(g, w, cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} bf16 wgrad", lambda: gemm(g.t(), x, cu_seqlens_k=cu, tuned=tuned), flops),
            (f"quack{t} fp8 fwd", lambda: gemm(xq, wq.transpose(1, 2), alpha=a_fwd, out_dtype=x.dtype,
                                               cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} fp8 dgrad", lambda: gemm(gq, wtq.transpose(1, 2), alpha=a_dgrad, out_dtype=x.dtype,
                                                 cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} fp8 wgrad", lambda: gemm(gtq, xtq.t(), alpha=a_wgrad, out_dtype=x.dtype, cu_seqlens_k=cu,
                                                 tuned=tuned), flops)]


def function_cases(x, w, g, ends):
    """(label, forward fn, forward + backward fn) of the experts' whole GEMM per recipe, quantisation included."""
    from paratron.fp8.experts import fp8_grouped_mm
    from paratron.fp8.recipe import FP8State

    def bf16():
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    out = [("bf16", bf16, lambda: torch.autograd.grad(bf16(), (x, w), g))]
    for label, recipe in recipes():
        state = FP8State(recipe, x.device)
        fwd = (lambda s=state: fp8_grouped_mm(x, w, ends, s))
        out.append((label, fwd, lambda f=fwd: torch.autograd.grad(f(), (x, w), g)))
    return out


def dense_cases(x, w, g):
    """(label, fn, flops) of one dense linear's three GEMMs in bf16, tensorwise FP8 (``torch._scaled_mm``) and
    blockwise FP8 (cuBLAS's block-scaled GEMM), from operands quantised beforehand, and the casts each recipe
    makes of the input and the output gradient (compiled, as under --torch-compile): row-major and transposed."""
    from paratron.fp8.recipe import FP8State, Recipe, column_major, scaled_mm
    from paratron.kernels.fp8_block import block_mm, quantize_blocks, quantize_tiles
    from paratron.kernels.fp8_tile_cast import tiles_both
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    st = FP8State(Recipe(format="e4m3"), x.device)
    xq, xtq, sx = st.input.quantize_both(x)
    wq, sw = st.quantize("weight", w)
    gq, gtq, sg = st.quantize_grad(g)
    wcm, bxq, bsx = column_major(wq), *quantize_tiles(x)
    bxt, bsxt = quantize_tiles(x.t())
    bgq, bsg = quantize_tiles(g)
    bgt, bsgt = quantize_tiles(g.t())
    bw, bsw = quantize_blocks(w)
    both = torch.compile(lambda t: (quantize_tiles(t), quantize_tiles(t.t())))
    return [("bf16 fwd", lambda: x @ w.t(), flops), ("bf16 dgrad", lambda: g @ w, flops),
            ("bf16 wgrad", lambda: g.t() @ x, flops),
            ("tensor fwd", lambda: scaled_mm(xq, wq.t(), sx, sw, x.dtype, False), flops),
            ("tensor dgrad", lambda: scaled_mm(gq, wcm, sg, sw, x.dtype, False), flops),
            ("tensor wgrad", lambda: scaled_mm(gtq, xtq.t(), sg, sx, x.dtype, False), flops),
            ("block fwd", lambda: block_mm(bxq, bsx, bw, bsw, True, x.dtype, "scaled_mm"), flops),
            ("block dgrad", lambda: block_mm(bgq, bsg, bw.t(), bsw.t(), True, x.dtype, "scaled_mm"), flops),
            ("block wgrad", lambda: block_mm(bgt, bsgt, bxt, bsxt, False, x.dtype, "scaled_mm"), flops),
            ("tensor cast x (+x^T)", lambda: st.input.quantize_both(x), 0),
            ("tensor cast g (+g^T)", lambda: st.quantize_grad(g), 0),
            ("block cast x (+x^T), compiled", lambda: both(x), 0),
            ("block cast g (+g^T), compiled", lambda: both(g), 0),
            ("block cast x (+x^T), triton", lambda: tiles_both(x, 0, "triton"), 0),
            ("block cast g (+g^T), triton", lambda: tiles_both(g, 0, "triton"), 0)]


def dense(preset: str, tokens: int) -> list[str]:
    from benchmarks.matmul_shapes import shapes
    dev, dt = torch.device("cuda"), torch.bfloat16
    lines = ["| linear | what | ms | TFLOP/s |", "|---|---|---|---|"]
    for name, fin, fout in shapes(preset)[:-1]:  # (the output layer stays in bf16 under FP8)
        torch.manual_seed(0)
        x, w = torch.randn(tokens, fin, device=dev, dtype=dt), torch.randn(fout, fin, device=dev, dtype=dt) / fin ** .5
        g = torch.randn(tokens, fout, device=dev, dtype=dt)
        for label, fn, flops in dense_cases(x, w, g):
            try:
                ms = time_ms(fn, [()])
            except Exception as e:  # a path this GPU or torch lacks: said, and the next one timed
                print(f"| {name} | {label} | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)
                continue
            lines.append(f"| {name} {tokens}x{fin}->{fout} | {label} | {ms:.3f} | "
                         f"{f'{flops / ms / 1e9:.0f}' if flops else ''} |")
            print(lines[-1], flush=True)
    return lines


def run(preset: str, tokens: int, quack: bool = False) -> list[str]:
    experts, rows, gemms = expert_shapes(preset, tokens)
    per = rows // experts // 128 * 128
    dev, dt = torch.device("cuda"), torch.bfloat16
    ends = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * per
    s = per * experts
    lines = ["| GEMM | what | ms | TFLOP/s |", "|---|---|---|---|"]
    for name, k, n in gemms:
        torch.manual_seed(0)
        x = torch.randn(s, k, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(experts, n, k, device=dev, dtype=dt) * k ** -0.5).requires_grad_(True)
        g = torch.randn(s, n, device=dev, dtype=dt)
        xd, wd = x.detach(), w.detach()
        cases = kernel_cases(xd, wd, g, ends)
        if quack:
            cases = [c for tuned in (False, True) for c in quack_cases(xd, wd, g, ends, tuned)]
        refs = {"fwd": lambda: torch._grouped_mm(xd, wd.transpose(-2, -1), offs=ends),
                "dgrad": lambda: torch._grouped_mm(g, wd, offs=ends),
                "wgrad": lambda: torch._grouped_mm(g.t(), xd, offs=ends)}
        for label, fn, flops in cases:
            try:
                ms = time_ms(fn, [()])
                if quack:  # the product checked against torch's bf16 grouped GEMM
                    ref = refs[label.split()[-1]]().float()
                    label += f" (rel. diff {((fn().float() - ref).norm() / ref.norm()).item():.1e})"
            except Exception as e:  # a path this GPU or torch lacks: said, and the next one timed
                print(f"| {name} | kernel: {label} | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)
                continue
            lines.append(f"| {name} {s}x{k}->{n}, {experts} experts | kernel: {label} | {ms:.3f} | "
                         f"{flops / ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
        flops = 2 * s * k * n
        for label, fwd, both in ([] if quack else function_cases(x, w, g, ends)):
            f_ms, b_ms = time_ms(fwd, [()]), time_ms(both, [()])
            lines.append(f"| {name} | function: {label} forward | {f_ms:.3f} | {flops / f_ms / 1e9:.0f} |")
            lines.append(f"| {name} | function: {label} fwd+bwd | {b_ms:.3f} | {3 * flops / b_ms / 1e9:.0f} |")
            print(*lines[-2:], sep="\n", flush=True)
        del x, w, g
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="moe-mini")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch (micro-batch x sequence)")
    p.add_argument("--quack", action="store_true", help="quack-kernels' variable-length GEMM instead (bf16 and FP8; "
                   "its default tile and autotuned)")
    p.add_argument("--dense", action="store_true", help="the dense linears' GEMMs and casts instead: bf16, "
                   "tensorwise and blockwise FP8")
    args = p.parse_args()
    from benchmarks.record import write_record
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {args.config}, {args.tokens} tokens")
    lines = dense(args.config, args.tokens) if args.dense else run(args.config, args.tokens, args.quack)
    kind = "_quack" if args.quack else "_dense" if args.dense else ""
    what = "dense linears" if args.dense else "routed experts"
    write_record(os.environ.get("OUT") or Path(__file__).resolve().parent / "results",
                 f"expert_gemms_{args.config}{kind}",
                 f"The {what}' GEMMs of {args.config}, bf16 and FP8, alone",
                 torch.cuda.get_device_name(), {"tokens per micro-batch": args.tokens},
                 "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
