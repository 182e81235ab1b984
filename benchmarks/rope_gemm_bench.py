"""The QKV GEMM with the rotary embedding in its epilogue (benchmarks/rope_gemm_kernel.py) against today's
path, at llama-1b's attention shape on the GPU: cuBLAS's QKV GEMM + rope_kernels.rotate_qk, against the
weight's row permutation + rope_gemm_kernel.gemm_rope per tile configuration. Checks first that the epilogue's
rotation is bit-identical to the torch rotation (apply_rotary's rounding) of the same kernel's unrotated
output, and how far that output is from cuBLAS's product. Writes a record.

    python benchmarks/rope_gemm_bench.py        (on the device: . benchmarks/quack_env.sh first)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import at_power_limit, cuda_median_ms, write_record  # noqa: E402
from paratron.model import rope_kernels  # noqa: E402
import rope_gemm_kernel  # noqa: E402


def _config(spec: str) -> rope_gemm_kernel.Config:
    """"128x192c2x1pp" -> Config."""
    tiles, rest = spec.split("c", 1)
    tm, tn = (int(v) for v in tiles.split("x"))
    cm, cn = int(rest[0]), int(rest[2])
    return rope_gemm_kernel.Config(tm, tn, cm, cn, rest.endswith("pp"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--configs", default="128x192c1x2pp,128x192c2x1pp,128x256c1x2pp,128x256c2x1pp,"
                                        "128x256c2x1coop,256x128c1x2coop,256x192c2x1coop,256x192c1x2coop")
    p.add_argument("--cap-s", type=float, default=2.0)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    qpg, t = a.heads // a.groups, a.seq * a.batch
    n_out, rope_cols = (a.heads + 2 * a.groups) * a.d, (a.heads + a.groups) * a.d
    x = torch.randn(t, a.hidden, device=dev, dtype=bf16)
    w = torch.randn(n_out, a.hidden, device=dev, dtype=bf16) * a.hidden ** -0.5
    inv = 1.0 / 500000.0 ** (torch.arange(0, a.d, 2, dtype=torch.float32) / a.d)
    freqs = torch.outer(torch.arange(a.seq, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dev, bf16), emb.sin().to(dev, bf16)
    wp = rope_gemm_kernel.perm_weight(w, a.groups, qpg)
    def today():
        qkv = x @ w.t()
        rope_kernels.rotate_qk(qkv.view(a.seq, a.batch, a.groups, qpg + 2, a.d), cos, sin)
    rows = []
    exact_all = True
    for spec in a.configs.split(","):
        cfg = _config(spec)
        try:
            plain = rope_gemm_kernel.gemm_rope(x, wp, cos, sin, a.batch, 0, cfg)
            fused = rope_gemm_kernel.gemm_rope(x, wp, cos, sin, a.batch, rope_cols, cfg)
        except Exception as e:  # noqa: BLE001 - a configuration the kernel does not take: reported
            rows.append(f"| {spec} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |")
            continue
        ref = rope_gemm_kernel.gemm_rope_ref(plain, torch.eye(n_out, device=dev, dtype=bf16), cos, sin, a.batch,
                                       rope_cols)
        exact = torch.equal(fused, ref)
        exact_all &= exact
        if not exact:
            bad = (fused != ref).nonzero()
            print(f"{spec}: {len(bad)} of {fused.numel()} differ; columns "
                  f"{sorted(set((bad[:, 1] % a.d).tolist()))[:16]}", flush=True)
            for r0, c0 in bad[:4].tolist():
                i, pos = c0 % a.d, r0 // a.batch
                pc = c0 + a.d // 2 if i < a.d // 2 else c0 - a.d // 2
                print(f"  row {r0} col {c0} (pos {pos}, i {i}): fused {fused[r0, c0].item()} ref "
                      f"{ref[r0, c0].item()} x {plain[r0, c0].item()} partner x {plain[r0, pc].item()} cos "
                      f"{cos[pos, i].item()} sin {sin[pos, i].item()} fused partner {fused[r0, pc].item()} "
                      f"ref partner {ref[r0, pc].item()}", flush=True)
        cublas_diff = (plain.float() - (x @ wp.t()).float()).abs().max().item()

        def run(cfg=cfg):
            w_perm = rope_gemm_kernel.perm_weight(w, a.groups, qpg)
            rope_gemm_kernel.gemm_rope(x, w_perm, cos, sin, a.batch, rope_cols, cfg)
        at_power_limit(run, a.cap_s)
        ms = cuda_median_ms(run)
        today_ms = cuda_median_ms(today)
        bare = cuda_median_ms(lambda cfg=cfg: rope_gemm_kernel.gemm_rope(x, wp, cos, sin, a.batch, 0, cfg))
        flops = 2 * t * a.hidden * n_out
        rows.append(f"| {spec} | {exact} | {cublas_diff:.3g} | {ms:.4f} | {flops / ms / 1e9:.0f} | {bare:.4f} "
                    f"| {today_ms:.4f} |")
        print(rows[-1], flush=True)

    at_power_limit(today, a.cap_s)
    base = cuda_median_ms(today)
    gemm_only = cuda_median_ms(lambda: x @ w.t())
    qkv5 = (x @ w.t()).view(a.seq, a.batch, a.groups, qpg + 2, a.d)
    rot_only = cuda_median_ms(lambda: rope_kernels.rotate_qk(qkv5, cos, sin))
    perm_only = cuda_median_ms(lambda: rope_gemm_kernel.perm_weight(w, a.groups, qpg))
    body = "\n".join([
        f"Shape: tokens {t} (seq {a.seq} x batch {a.batch}), hidden {a.hidden}, {a.heads} query heads / "
        f"{a.groups} groups of d {a.d}: QKV output {n_out} columns, {rope_cols} rotated.",
        "",
        f"Today: cuBLAS QKV GEMM + rotate_qk **{base:.4f} ms** (GEMM alone {gemm_only:.4f}, rotate_qk alone "
        f"{rot_only:.4f}); the weight permutation alone {perm_only:.4f} ms.",
        "",
        "| gemm_rope config | bit-identical to the torch rotation | max abs diff of its product vs cuBLAS | "
        "ms (with the permutation) | TFLOP/s | ms without rotation or permutation | today's ms, timed next |",
        "|---|---|---|---|---|---|---|", *rows])
    print(body)
    write_record(a.out, "rope_gemm", "QKV GEMM with the rotary embedding in its epilogue",
                 torch.cuda.get_device_name(), {"all bit-identical": exact_all}, body)


if __name__ == "__main__":
    main()
