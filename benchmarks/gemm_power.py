"""Which GEMM kernels are fastest at the GPU's power limit? The step runs at the H100's 700 W cap (SM clock
~1,400 MHz, benchmarks/results/perf_notes.md, eleventh session), so a kernel's figure alone at full clock
says little. For llama-1b's heavy GEMM shapes (32,768 tokens) each candidate runs back to back for
``--seconds`` after ``--warm`` seconds of warm-up at the cap: cuBLAS (torch.mm), quack's GEMM with several
tile / cluster configurations (when importable), and for the weight gradient the fp32 accumulation two ways
(bf16 GEMM + an add into the fp32 buffer, or one GEMM with fp32 output accumulating in place, Megatron's
gradient-accumulation fusion). Reports TFLOP/s with the mean SM clock and power (NVML).

    python benchmarks/gemm_power.py [--seconds 2 --warm 1 --no-quack] [--gated | --residual]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from paratron.parallel.grad_accumulation import accumulate_  # noqa: E402

GATED_CONFIGS = [(128, 192, 2, 1, True), (128, 128, 2, 1, True), (256, 128, 1, 2, False), (256, 192, 2, 1, False),
                 (128, 256, 1, 2, False), (256, 128, 2, 1, False), (128, 128, 1, 2, True), (128, 160, 2, 1, True),
                 (128, 192, 1, 2, True), (192, 128, 2, 1, True)]
RESIDUAL_SPECS = ["default", "256x128c1x2coop", "128x256c1x2coop", "256x192c2x1coop", "256x128c2x1coop"]
CONFIGS = [  # (tile_m, tile_n, cluster_m, cluster_n, pingpong)
    (128, 192, 2, 1, True), (256, 128, 2, 1, False), (256, 128, 1, 2, False), (256, 192, 2, 1, False),
    (128, 256, 1, 2, False)]


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: (pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
    except Exception:  # noqa: BLE001 - no NVML: no clock / power columns
        return None


def sustained(fn, flops: float, seconds: float, warm: float, probe) -> tuple[float, float, float]:
    """(TFLOP/s, mean SM MHz, mean W) of ``fn`` run back to back for ``seconds`` after ``warm``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm:
        fn()
        torch.cuda.synchronize()
    calls, clocks, watts = 0, [], []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
        if probe:
            c, w = probe()
            clocks.append(c)
            watts.append(w)
    dt = time.perf_counter() - t0
    mean = (lambda v: sum(v) / len(v) if v else float("nan"))
    return calls * flops / dt / 1e12, mean(clocks), mean(watts)


def quack_candidates(a, b, out):
    """{name: callable} for quack's GEMM ``out = a @ b`` with each configuration of CONFIGS."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_tuned
    except Exception as e:  # noqa: BLE001
        print(f"quack not importable ({type(e).__name__}: {e}); cuBLAS only")
        return {}
    raw = getattr(gemm_tuned, "fn", gemm_tuned)
    found = {}
    for tm, tn, cm, cn, pp in CONFIGS:
        cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, is_dynamic_persistent=False)
        found[f"quack {tm}x{tn} c{cm}x{cn} {'pp' if pp else 'coop'}"] = (
            lambda cfg=cfg: raw(a, b, out, config=cfg))
    return found


def residual_candidates(n: int, r) -> list:
    """[(name, flops, {kernel: callable})]: output projection and fc2 forward with the residual (C) added
    into a new tensor, and fc1's input gradient from the [gate; up] weight read in the interleaved order:
    cuBLAS as paratron's plain path runs them, quack_gemm.py's ops per tile configuration."""
    from paratron.parallel import cublaslt, quack_gemm, quack_kernels
    rows = []
    for name, k in (("proj forward + residual", 2048), ("fc2 forward + residual", 8192)):
        a, w, c = r(n, k), r(2048, k), r(n, 2048)
        cands = {"cuBLAS addmm (C copied, then GEMM)": lambda a=a, w=w, c=c: torch.addmm(c, a, w.t()),
                 "cuBLAS addmm in place (no copy)": lambda a=a, w=w, c=c: torch.addmm(c, a, w.t(), out=c),
                 "cuBLASLt C != D (cublaslt.addmm, its choice)": lambda a=a, w=w, c=c: cublaslt.addmm(c, a, w)}
        for spec in RESIDUAL_SPECS:
            cands[f"quack {spec}"] = lambda a=a, w=w, c=c, spec=spec: quack_gemm.gemm_add(c, a, w, spec)
        rows.append((name, 2 * n * k * 2048, cands))
    dpre, w1 = r(n, 16384), r(16384, 2048)
    cands = {"cuBLAS, weight re-ordered": lambda: dpre @ quack_kernels.interleave(w1)}
    for spec in RESIDUAL_SPECS:
        cands[f"quack {spec}"] = lambda spec=spec: quack_gemm.gemm_interleaved(dpre, w1, spec)
    rows.append(("fc1 input grad, interleaved weight", 2 * n * 16384 * 2048, cands))
    return rows


def lt_candidates(a, w, out) -> dict:
    """cuBLASLt's heuristic candidates (cublaslt.py) for out = a @ w^T (w [n, k], rows or columns contiguous),
    beta 0: the algorithms the first-call timing chooses among."""
    from paratron.parallel import cublaslt
    w_rows = w.stride(1) == 1
    plan = cublaslt._plan(0, a.size(0), w.size(0), a.size(1), a.stride(0), w.stride(0 if w_rows else 1), out.size(1),
                          w_rows, True)
    ref, found = a @ w.t(), {}
    for i, algo in enumerate(plan.candidates):
        cublaslt._matmul(plan, algo, 0, out, a, w, out, 0.0)
        ok = ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        found[f"cuBLASLt candidate {i}{'' if ok else ' WRONG RESULT'}"] = (
            lambda algo=algo: cublaslt._matmul(plan, algo, 0, out, a, w, out, 0.0))
    return found


def gated_candidates(n: int, r) -> list:
    """[(name, flops, {kernel: callable})]: quack's gated GEMMs of llama-1b's MLP (fc1 + SwiGLU forward, fc2's
    input gradient + SwiGLU backward) with each configuration of GATED_CONFIGS; the default is what
    paratron's ``tuned=False`` calls take."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_dgated_tuned, gemm_gated_tuned
    fwd, bwd = getattr(gemm_gated_tuned, "fn", gemm_gated_tuned), getattr(gemm_dgated_tuned, "fn", gemm_dgated_tuned)
    x, w1, dy, w2 = r(n, 2048), r(16384, 2048), r(n, 2048), r(2048, 8192)
    pre, act, dpre = r(n, 16384), r(n, 8192), r(n, 16384)
    rows = [("fc1 + SwiGLU forward (gated)", 2 * n * 2048 * 16384, {}),
            ("fc2 input grad + SwiGLU backward (dgated)", 2 * n * 2048 * 8192, {})]
    for tm, tn, cm, cn, pp in GATED_CONFIGS:
        cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, is_dynamic_persistent=False)
        name = f"quack {tm}x{tn} c{cm}x{cn} {'pp' if pp else 'coop'}"
        rows[0][2][name] = lambda cfg=cfg: fwd(x, w1.t(), pre, act, activation="swiglu", config=cfg,
                                               concat_layout=("B",))
        rows[1][2][name] = lambda cfg=cfg: bwd(dy, w2, pre, dpre, act, activation="swiglu", config=cfg)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--warm", type=float, default=1.0)
    p.add_argument("--no-quack", action="store_true")
    p.add_argument("--lt", action="store_true", help="cuBLASLt's heuristic candidates instead of quack's tiles")
    p.add_argument("--gated", action="store_true", help="only quack's gated MLP GEMMs, per configuration")
    p.add_argument("--residual", action="store_true",
                   help="only the GEMMs paratron/parallel/quack_gemm.py configures: C + A@B into a new tensor "
                        "(torch's addmm copies C first) and fc1's input gradient from the interleaved weight")
    args = p.parse_args()
    from paratron.parallel import cublaslt
    n, dev, dt = args.tokens, "cuda", torch.bfloat16
    probe = _nvml()
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    # (name, A, B): out = A @ B; A / B in the step's layouts
    shapes = [("fc2 forward act@W2^T", r(n, 8192), r(2048, 8192).t()),
              ("fc1 input grad dpre@W1", r(n, 16384), r(16384, 2048)),
              ("fc2 weight grad dy^T@act", r(n, 2048).t(), r(n, 8192)),
              ("qkv forward x@Wqkv^T", r(n, 2048), r(3072, 2048).t())]
    if args.lt:  # and the other GEMMs of the step that run on cuBLAS
        shapes += [("qkv input grad dqkv@Wqkv", r(n, 3072), r(3072, 2048)),
                   ("proj input grad dy@Wo", r(n, 2048), r(2048, 2048)),
                   ("logits x@Wout^T", r(n, 2048), r(32768, 2048).t()),
                   ("logits input grad dlogits@Wout", r(n, 32768), r(32768, 2048))]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.seconds} s each after {args.warm} s")
    print("| GEMM | kernel | TFLOP/s | SM MHz | W |\n|---|---|---|---|---|")
    if args.gated or args.residual:
        for name, flops, cands in (gated_candidates if args.gated else residual_candidates)(n, r):
            _table(name, flops, cands, args, probe)
        return 0
    for name, a, b in shapes:
        flops = 2 * a.size(0) * a.size(1) * b.size(1)
        out_ = torch.empty(a.size(0), b.size(1), device=dev, dtype=dt)
        cands = {"cuBLAS": lambda a=a, b=b, o=out_: torch.mm(a, b, out=o)}
        if "weight grad" in name:
            acc = torch.zeros(a.size(0), b.size(1), device=dev, dtype=torch.float32)
            cands["cuBLAS bf16 + Triton add into fp32"] = lambda a=a, b=b, acc=acc, o=out_: accumulate_(acc, torch.mm(a, b, out=o), write=False)
            cands["cuBLAS fp32 out, in place (fused)"] = lambda a=a, b=b, acc=acc: torch.addmm(
                acc, a, b, out_dtype=torch.float32, out=acc)
        if args.lt and "weight grad" not in name:
            cands.update(lt_candidates(a, b.t(), out_))
            cands["cublaslt.mm (its choice)"] = lambda a=a, b=b: cublaslt.mm(a, b.t())
        elif not args.no_quack:
            cands.update(quack_candidates(a, b, out_))
        _table(name, flops, cands, args, probe)
    return 0


def _table(name: str, flops: float, cands: dict, args, probe) -> None:
    """One table row per candidate kernel of one GEMM."""
    for kname, fn in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a configuration the kernel refuses: say so, go on
            print(f"| {name} | {kname} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        tf, mhz, w = sustained(fn, flops, args.seconds, args.warm, probe)
        print(f"| {name} | {kname} | {tf:.0f} | {mhz:.0f} | {w:.0f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
