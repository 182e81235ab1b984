"""The backward's GEMM-side levers at the H100's power limit, each candidate checked against the current path:

1. ``dgated``: fc2's input gradient + SwiGLU's backward (quack's gemm_dgated, which also writes the activation
   again) against ``quack_dgated.gemm_dgated_keep`` (the same kernel without that store; the forward's
   activation kept instead). d[gate, up] must be bit-identical.
2. ``wgrad``: the weight gradients into the fp32 ``main_grad``: cuBLAS (fc1: bf16 product + the Triton
   de-interleaving add; the others: fp32 output accumulating in place) against quack's GEMM adding into the
   buffer by TMA reduce-add (fc1: writing the [gate; up] row order itself, ``concat_layout=("out",)``).
3. ``attention``: FlashAttention-4 at llama-1b's shape, forward tiles and backward configurations.
4. ``cudnn``: cuDNN's fused forward (``aten._scaled_dot_product_cudnn_attention``, on the sequence-first views)
   against FlashAttention-4's, and FlashAttention-4's backward from cuDNN's output and log-sum-exp.

Each timed back to back after a warm-up at the cap (benchmarks/gemm_power.py's ``sustained``). Prints tables;
``--out DIR`` writes them there too.

    python benchmarks/backward_levers.py [--only dgated,wgrad,attention] [--seconds 1.5 --warm 0.75]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gemm_power import _nvml, sustained  # noqa: E402
from paratron.parallel import quack_dgated, quack_gemm  # noqa: E402
from paratron.parallel.grad_accumulation import wgrad_accumulate  # noqa: E402

T, H, F = 32768, 2048, 8192
DGATED = ["128x128c2x1pp", "128x192c2x1pp", "128x160c2x1pp", "128x128c1x2pp", "128x256c1x2coop"]
WGRAD = ["256x128c1x2coop", "128x256c2x1coop", "256x128c2x1coop", "128x192c2x1pp"]
SHAPES = {"fc1": ("fc1 [16384, 2048] interleaved", 2 * F, H, True), "fc2": ("fc2 [2048, 8192]", H, F, False),
          "qkv": ("qkv [3072, 2048]", 3072, H, False), "proj": ("proj [2048, 2048]", H, H, False)}


def _row(name, fn, flops, args, probe, note=""):
    tf, mhz, w = sustained(fn, flops, args.seconds, args.warm, probe)
    return f"| {name} | {tf:.0f} | {mhz:.0f} | {w:.0f} | {note} |"


def dgated(args, probe) -> list:
    dy, w2 = torch.randn(T, H, device="cuda").bfloat16(), (torch.randn(H, F, device="cuda") / 64).bfloat16()
    pre = torch.randn(T, 2 * F, device="cuda").bfloat16()
    flops = 2 * T * H * F
    rows = ["| dgated (fc2 dgrad + SwiGLU bwd, 32768 tokens) | TFLOP/s | MHz | W | check |", "|---|---|---|---|---|"]
    for spec in args.dgated_specs:
        try:
            quack = (lambda: quack_gemm.gemm_dgated(dy, w2, pre, spec))  # noqa: E731
            keep = (lambda: quack_dgated.gemm_dgated_keep(dy, w2, pre, quack_gemm.config(spec)))  # noqa: E731
            ref, got = quack()[0], keep()
            diff = (ref.float() - got.float()).abs().max().item()
            same = "bit-identical" if torch.equal(ref, got) else f"DIFFERS (max {diff:.3g})"
            rows.append(_row(f"quack dgated {spec}", quack, flops, args, probe))
            rows.append(_row(f"keep-act {spec}", keep, flops, args, probe, same))
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile: say so, go on
            rows.append(f"| {spec} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
        print(rows[-1], flush=True)
    for swizzle in args.dgated_swizzles:  # the scheduler's swizzle (a runtime argument: no new kernel)
        cfg = dataclasses.replace(quack_gemm.config(args.dgated_specs[0]), max_swizzle_size=swizzle)
        rows.append(_row(f"keep-act {args.dgated_specs[0]} swizzle {swizzle}",
                         lambda: quack_dgated.gemm_dgated_keep(dy, w2, pre, cfg), flops, args, probe))
        print(rows[-1], flush=True)
    return rows


def wgrad(args, probe) -> list:
    rows = ["| weight gradient into fp32 main_grad | TFLOP/s | MHz | W | check |", "|---|---|---|---|---|"]
    for name, out_f, in_f, inter in args.shapes:
        dy, x = torch.randn(T, out_f, device="cuda").bfloat16(), torch.randn(T, in_f, device="cuda").bfloat16()
        ref = torch.zeros(out_f, in_f, device="cuda")
        wgrad_accumulate(ref, dy, x, inter)
        g = torch.zeros_like(ref)
        flops = 2 * T * out_f * in_f
        rows.append(_row(f"{name}: cuBLAS (current)", lambda: wgrad_accumulate(g, dy, x, inter), flops, args, probe))
        for spec in args.wgrad_specs:
            try:
                g.zero_()
                quack_gemm.gemm_accumulate(g, dy, x, inter, spec)
                err = ((g - ref).norm() / ref.norm()).item()
                rows.append(_row(f"{name}: quack add {spec}", lambda: quack_gemm.gemm_accumulate(g, dy, x, inter, spec),
                                 flops, args, probe, f"rel. diff {err:.2e}"))
            except Exception as e:  # noqa: BLE001
                rows.append(f"| {name}: quack {spec} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
            print(rows[-1], flush=True)
    return rows


def attention(args, probe) -> list:
    from flash_attn.cute import interface as fa
    b, s, h, kv, d = 16, 2048, 32, 8, 64
    q = torch.randn(b, s, h, d, device="cuda").bfloat16()
    k, v = torch.randn(2, b, s, kv, d, device="cuda").bfloat16()
    out, lse = fa._flash_attn_fwd(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    fwd_flops = 4 * b * h * s * s * d / 2
    rows = ["| FlashAttention-4, b16 s2048 h32 kv8 d64 causal | TFLOP/s | MHz | W | check |", "|---|---|---|---|---|"]
    for tile in (None, (128, 128), (128, 192), (128, 160), (192, 192)):
        try:
            o2, _ = fa._flash_attn_fwd(q, k, v, causal=True, return_lse=True, tile_mn=tile)
            same = "bit-identical" if torch.equal(o2, out) else f"max diff {(o2.float() - out.float()).abs().max():.3g}"
            rows.append(_row(f"forward tiles {tile or 'default (192, 128)'}",
                             lambda: fa._flash_attn_fwd(q, k, v, causal=True, return_lse=True, tile_mn=tile),
                             fwd_flops, args, probe, same))
        except Exception as e:  # noqa: BLE001
            rows.append(f"| forward {tile} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
        print(rows[-1], flush=True)
    default = fa._tile_size_bwd_sm90
    base = default(d, d, True, False)
    variants = {"default": base, "dQ_swapAB": base.__class__(**{**base.__dict__, "dQ_swapAB": True}),
                "64x128": base.__class__(**{**base.__dict__, "m_block_size": 64, "AtomLayoutMdQ": 1})}
    ref = fa._flash_attn_bwd(q, k, v, out, dout, lse, None, True)
    for name, cfg in variants.items():
        fa._tile_size_bwd_sm90 = lambda *a, cfg=cfg, **kw: cfg
        try:
            got = fa._flash_attn_bwd(q, k, v, out, dout, lse, None, True)
            err = max(((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(got, ref))
            rows.append(_row(f"backward {name}", lambda: fa._flash_attn_bwd(q, k, v, out, dout, lse, None, True),
                             2.5 * fwd_flops, args, probe, f"rel. diff {err:.2e}"))
        except Exception as e:  # noqa: BLE001
            rows.append(f"| backward {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
        finally:
            fa._tile_size_bwd_sm90 = default
        print(rows[-1], flush=True)
    return rows


def cudnn(args, probe) -> list:
    from flash_attn.cute import interface as fa
    b, s, h, kv, d = 16, 2048, 32, 8, 64
    q = torch.randn(s, b, h, d, device="cuda").bfloat16().transpose(0, 1)  # [b, s, ...] views of [s, b, ...]
    k, v = (torch.randn(s, b, kv, d, device="cuda").bfloat16().transpose(0, 1) for _ in range(2))
    scale = d ** -0.5

    def cudnn_fwd():
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, True, False, scale=scale)[:2]
        return o.transpose(1, 2), lse.reshape(b, h, s)
    out, lse = fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    fwd_flops = 4 * b * h * s * s * d / 2
    rows = ["| attention forward, sequence-first views | TFLOP/s | MHz | W | check |", "|---|---|---|---|---|"]
    rows.append(_row("FlashAttention-4 forward", lambda: fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True,
                                                                             return_lse=True), fwd_flops, args, probe))
    try:
        o2, lse2 = cudnn_fwd()
        dout = torch.randn_like(out)
        ref = fa._flash_attn_bwd(q, k, v, out, dout, lse, scale, True)
        got = fa._flash_attn_bwd(q, k, v, o2, dout, lse2.contiguous(), scale, True)
        rel = (lambda a, r: ((a.float() - r.float()).norm() / r.float().norm()).item())  # noqa: E731
        grads = "/".join(f"{rel(a, r):.1e}" for a, r in zip(got, ref))
        note = (f"out rel {rel(o2, out):.1e}, lse max {(lse2 - lse).abs().max().item():.1e}, out strides "
                f"{tuple(o2.stride())}, FA4 bwd from it: grads rel {grads}")
        rows.append(_row("cuDNN forward", cudnn_fwd, fwd_flops, args, probe, note))
    except Exception as e:  # noqa: BLE001
        rows.append(f"| cuDNN forward | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
    print("\n".join(rows[-2:]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="dgated,wgrad,attention,cudnn")
    p.add_argument("--wgrad-shapes", default="fc1,fc2,qkv", help="of fc1, fc2, qkv, proj")
    p.add_argument("--wgrad-specs", default=",".join(WGRAD))
    p.add_argument("--dgated-specs", default=",".join(DGATED))
    p.add_argument("--dgated-swizzles", default="", help="the first spec's keep-act kernel at these scheduler "
                   "swizzle sizes (quack's default 8), e.g. 1,2,4,16")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--warm", type=float, default=0.75)
    p.add_argument("--out", default=None, help="directory for backward_levers.md")
    args = p.parse_args()
    args.shapes = [SHAPES[n] for n in args.wgrad_shapes.split(",")]
    args.wgrad_specs = args.wgrad_specs.split(",")
    args.dgated_specs = [x for x in args.dgated_specs.split(",") if x]
    args.dgated_swizzles = [int(x) for x in args.dgated_swizzles.split(",") if x]
    probe = _nvml()
    tables = [{"dgated": dgated, "wgrad": wgrad, "attention": attention, "cudnn": cudnn}[part](args, probe)
              for part in args.only.split(",")]
    text = "\n\n".join("\n".join(t) for t in tables)
    print(text)
    if args.out:
        head = f"# {__doc__.splitlines()[0]}\n\n{torch.cuda.get_device_name()}\n\n"
        Path(args.out, "backward_levers.md").write_text(head + text + "\n")


if __name__ == "__main__":
    main()
