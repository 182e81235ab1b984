"""The SwiGLU MLP of one layer at a preset's shapes, timed alone on the GPU: the plain path (cuBLAS fc1,
paratron's Triton SwiGLU, cuBLAS fc2 with the residual; backward by autograd) against the gated GEMMs
(``paratron.parallel.quack_kernels``: quack's gemm_gated / gemm_dgated), forward and forward + backward,
with the largest relative differences of the output and the three gradients between the two. Also
RMSNorm forward + backward (compiled torch vs quack's) and the weight gradient accumulated into an
fp32 buffer (cuBLAS + add vs quack's gemm_add_inplace), the other two candidates of the same library.

    python benchmarks/gated_mlp_bench.py --config llama-1b --tokens 32768
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from record import cuda_ms, write_record  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def mlp_rows(m: int, h: int, f: int) -> list[str]:
    from paratron.model.kernels import swiglu
    from paratron.parallel.quack_kernels import gated_mlp
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(m, h, device="cuda", generator=g) * 1.0).bfloat16().requires_grad_()
    res = torch.randn(m, h, device="cuda", generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(2 * f, h, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(h, f, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(m, h, device="cuda", generator=g).bfloat16()

    def plain():
        return torch.addmm(res, swiglu(x @ w1.t()), w2.t())

    paths = (("plain", plain), ("gated, fc1 backward on cuBLAS", lambda: gated_mlp(x, w1, w2, res, bwd="cublas")),
             ("gated, fc1 backward on quack", lambda: gated_mlp(x, w1, w2, res, bwd="quack")))
    outs = {}
    for name, fn in paths:
        for t in (x, res, w1, w2):
            t.grad = None
        y = fn()
        y.backward(dy)
        outs[name] = [y.detach(), x.grad, w1.grad, w2.grad, res.grad]
    errs = {name: [rel(a, b) for a, b in zip(outs[name], outs["plain"])] for name, _ in paths[1:]}
    flops = 2 * m * h * 3 * f  # fc1 (2F wide) + fc2
    rows = []
    for name, fn in paths:
        with torch.no_grad():
            fwd = cuda_ms(fn)
        both = cuda_ms(lambda: fn().backward(dy))
        rows.append(f"| {name} | {fwd:.3f} | {flops / fwd / 1e9:.0f} | {both:.3f} | {3 * flops / both / 1e9:.0f} |")
    for name, e in errs.items():  # (measured before the timing loops, which accumulate into .grad)
        rows += ["", f"relative difference (norm-wise) {name} vs plain: y {{:.2e}}, dx {{:.2e}}, dW1 {{:.2e}}, "
                 "dW2 {:.2e}, dresidual {:.2e}".format(*e)]
    return rows


def part_rows(m: int, h: int, f: int) -> list[str]:
    """The backward's parts alone: fc2's input gradient + SwiGLU backward, fc1's two GEMMs."""
    from paratron.parallel import quack_kernels as g
    from quack.gemm_interface import gemm
    x = torch.randn(m, h, device="cuda").bfloat16()
    w1 = (torch.randn(2 * f, h, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(h, f, device="cuda") * 0.02).bfloat16()
    dy = torch.randn(m, h, device="cuda").bfloat16()
    pre, _ = g.gated_ref(x, w1)
    dpre = torch.randn(m, 2 * f, device="cuda").bfloat16()
    plain_h = torch.cat((pre[:, 0::2], pre[:, 1::2]), dim=-1)
    cases = [
        ("fc1 + SwiGLU: cuBLAS + Triton SwiGLU", lambda: torch.ops.paratron.swiglu(x @ w1.t()), 2 * m * h * 2 * f),
        ("fc1 + SwiGLU: quack gemm_gated", lambda: g._gated(x, w1), 2 * m * h * 2 * f),
        ("fc2 dgrad + SwiGLU bwd: cuBLAS + Triton", lambda: torch.ops.paratron.swiglu_backward(plain_h, dy @ w2),
         2 * m * h * f),
        ("fc2 dgrad + SwiGLU bwd: quack gemm_dgated", lambda: g._dgated(dy, w2, pre), 2 * m * h * f),
        ("fc1 dgrad: cuBLAS (plain layout)", lambda: dpre @ w1, 2 * m * h * 2 * f),
        ("fc1 dgrad: cuBLAS + weight re-ordered", lambda: dpre @ g.interleave(w1), 2 * m * h * 2 * f),
        ("fc1 dgrad: quack concat_layout", lambda: gemm(dpre, w1, concat_layout=("B",), dynamic_scheduler=True,
                                                      tuned=False), 2 * m * h * 2 * f),
        ("fc1 wgrad: cuBLAS (plain layout)", lambda: dpre.t() @ x, 2 * m * h * 2 * f),
        ("fc1 wgrad: cuBLAS + gradient re-ordered", lambda: g._dw1(dpre, x, "cublas"), 2 * m * h * 2 * f),
        ("fc1 wgrad: quack concat_layout", lambda: gemm(dpre.t(), x, concat_layout=("out",), dynamic_scheduler=True,
                                                      tuned=False), 2 * m * h * 2 * f),
    ]
    rows = []
    for name, fn, fl in cases:
        t = cuda_ms(fn)
        rows.append(f"| {name} | {t:.3f} | {fl / t / 1e9:.0f} |")
    return rows


def config_rows(m: int, h: int, f: int) -> list[str]:
    """quack's gated forward and dgated backward under other tile configurations than its default."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_dgated_tuned, gemm_gated_tuned
    x = torch.randn(m, h, device="cuda").bfloat16()
    w1 = (torch.randn(2 * f, h, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(h, f, device="cuda") * 0.02).bfloat16()
    dy = torch.randn(m, h, device="cuda").bfloat16()
    pre = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
    dpre = torch.empty_like(pre)
    rows = []
    for tm, tn, pp, cm, cn in ((128, 192, True, 2, 1), (128, 256, False, 2, 1), (256, 128, False, 2, 1),
                               (256, 192, False, 1, 2), (128, 128, True, 2, 1)):
        c = GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=False)
        try:
            t1 = cuda_ms(lambda: gemm_gated_tuned.fn(x, w1.t(), pre, act, config=c, concat_layout=("B",)))
        except Exception as e:  # noqa: BLE001
            t1 = float("nan")
            print("gated", c, type(e).__name__, str(e)[:200], flush=True)
        try:
            t2 = cuda_ms(lambda: gemm_dgated_tuned.fn(dy, w2, pre, dpre, act, config=c))
        except Exception as e:  # noqa: BLE001
            t2 = float("nan")
            print("dgated", c, type(e).__name__, str(e)[:200], flush=True)
        rows.append(f"| {tm}x{tn} {'pingpong' if pp else 'cooperative'} cluster {cm}x{cn} | {t1:.3f} | "
                    f"{2 * m * h * 2 * f / t1 / 1e9:.0f} | {t2:.3f} | {2 * m * h * f / t2 / 1e9:.0f} |")
    return rows


def norm_rows(m: int, h: int) -> list[str]:
    from quack import rmsnorm
    x = torch.randn(m, h, device="cuda").bfloat16().requires_grad_()
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, h, device="cuda").bfloat16()
    compiled = torch.compile(lambda a, b: b * F.rms_norm(a.float(), (h,), eps=1e-5).to(a.dtype))  # paratron's Norm
    rows = []
    ref = None
    for name, fn in (("compiled torch (paratron's Norm)", lambda: compiled(x, w)),
                     ("quack", lambda: rmsnorm(x, w, eps=1e-5))):
        y = fn()
        ref = y.detach() if ref is None else ref
        with torch.no_grad():
            fwd = cuda_ms(fn)
        both = cuda_ms(lambda: fn().backward(dy))
        rows.append(f"| {name} | {fwd:.3f} | {both:.3f} | {rel(y, ref):.1e} |")
    return rows


def wgrad_rows(m: int, h: int, f: int) -> list[str]:
    from quack.gemm_interface import gemm_add_inplace
    dy = torch.randn(m, 2 * f, device="cuda").bfloat16()
    x = torch.randn(m, h, device="cuda").bfloat16()
    main = torch.zeros(2 * f, h, device="cuda")
    ref = (dy.float().t() @ x.float())

    def cublas():
        main.add_(dy.t() @ x)

    def quack():
        gemm_add_inplace(dy.t(), x, main, tuned=False)

    rows = []
    for name, fn in (("cuBLAS bf16 + add into fp32", cublas), ("quack gemm_add_inplace fp32", quack)):
        main.zero_()
        fn()
        err = rel(main, ref)
        t = cuda_ms(fn)
        rows.append(f"| {name} | {t:.3f} | {2 * m * h * 2 * f / t / 1e9:.0f} | {err:.1e} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (micro-batch x sequence)")
    a = p.parse_args()
    from paratron.config import parse_args
    m = parse_args(["--config", a.config]).model
    h, f, n = m.hidden_size, m.ffn_hidden_size, a.tokens
    body = [f"## SwiGLU MLP, {n} tokens, hidden {h}, ffn {f}", "",
            "| path | forward ms | TFLOP/s | fwd + bwd ms | TFLOP/s |", "|---|---|---|---|---|"]
    body += mlp_rows(n, h, f)
    print("\n".join(body), flush=True)
    for title, head, fn in (
            ("Backward parts alone", ["| part | ms | TFLOP/s |", "|---|---|---|"], lambda: part_rows(n, h, f)),
            ("quack tile configurations", ["| config | gated fwd ms | TFLOP/s | dgated ms | TFLOP/s |",
                                           "|---|---|---|---|---|"], lambda: config_rows(n, h, f)),
            ("RMSNorm", ["| kernel | forward ms | fwd + bwd ms | rel. diff of y |", "|---|---|---|---|"],
             lambda: norm_rows(n, h)),
            ("fc1 weight gradient accumulated into fp32",
             ["| path | ms | TFLOP/s | rel. error vs fp32 |", "|---|---|---|---|"], lambda: wgrad_rows(n, h, f))):
        try:
            part = fn()
        except Exception as e:  # noqa: BLE001 - a probe: record the failure and go on
            part = [f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"]
        body += ["", f"## {title}", "", *head, *part]
        print("\n".join(["", f"## {title}", *head, *part]), flush=True)
    write_record(Path(__import__("os").environ.get("OUT") or ROOT / "benchmarks" / "results"),
                 f"gated_mlp_{a.config}", f"Gated-GEMM SwiGLU MLP vs plain ({a.config})",
                 torch.cuda.get_device_name(), {"tokens": str(n)}, "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
