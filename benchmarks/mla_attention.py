"""Multi-latent attention's core on one GPU: which SDPA kernel takes keys of dim 192 with values of
dim 128 (DeepSeek's qk 128 + rotary 64, v 128), how fast, and whether padding the values to 192 (as
paratron's context-parallel path does) to reach the flash kernel is faster.

    python benchmarks/mla_attention.py [--batch 2] [--heads 16] [--seq 4096]

Prints fwd+bwd milliseconds (causal, bf16) per backend for the unpadded and the padded values and
writes a Markdown record to $OUT (else benchmarks/results).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import cuda_ms, write_record  # noqa: E402  (benchmarks/record.py)

QK, V = 192, 128


def bench(fn, iters: int = 20) -> float:
    return cuda_ms(fn, iters)


def step_fn(q, k, v, pad: bool):
    def step():
        vv = F.pad(v, (0, QK - V)) if pad else v
        out = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=QK ** -0.5)
        out[..., :V].sum().backward()
    return step


ALL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]  # torch's own choice among them (the enum is not iterable on torch 2.11)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args()
    make = lambda d: torch.randn(a.batch, a.heads, a.seq, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 requires_grad=True)
    q, k, v = make(QK), make(QK), make(V)
    rows = ["| values | backend | fwd+bwd ms |", "|---|---|---|"]
    for pad in (False, True):
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        None):
            name = backend.name if backend else "default choice"
            try:
                with sdpa_kernel([backend] if backend else ALL_BACKENDS):
                    ms = f"{bench(step_fn(q, k, v, pad)):.2f}"
            except RuntimeError as e:
                ms = f"cannot run ({str(e).splitlines()[0][:80]})"
            rows.append(f"| {'padded to 192' if pad else 'dim 128'} | {name} | {ms} |")
            print(rows[-1], flush=True)
    write_record(os.environ.get("OUT") or Path(__file__).parent / "results", "mla_attention",
                 "MLA core attention: keys 192, values 128", torch.cuda.get_device_name(),
                 {"shape": f"batch {a.batch}, heads {a.heads}, seq {a.seq}, causal, bf16"}, "\n".join(rows))


if __name__ == "__main__":
    main()
