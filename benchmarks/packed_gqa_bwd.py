"""FlashAttention-4's Hopper backward with a group's query heads packed into one CTA's rows
(paratron/model/flash_packed.py) against FlashAttention-4's own grouped backward: the gradients compared, the
backwards timed and their kernels profiled.

Measured on H100s: correct (dq within 2e-4 of its largest value, dk / dv within 2.4e-3: bf16 roundings of fp32
sums in another order); per call, the packed main kernel 1.370 against 1.463 ms and no dK / dV fills or
conversions (benchmarks/results/packed_gqa_bwd_20261126_230214.md). Its backward timings in the table include a
copy of dq out of the packed buffer made here for the comparison (0.198 ms; the model's rotary backward reads the
buffer in place): 1.991 against 1.973 / 2.055 ms (packed_gqa_bwd_20261126_225858.md).

    python benchmarks/packed_gqa_bwd.py        (on the device: . benchmarks/quack_env.sh first)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from paratron.model import flash_packed  # noqa: E402


def packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, longest_first: bool = True):
    """flash_packed.backward's dq as [b, s, heads, d] (a copy out of its packed buffer, for the comparisons)."""
    b, s, heads, d = q.shape
    buf = flash_packed.backward(dout, q, k, v, out, lse, scale, dk, dv, longest_first)
    return buf.permute(0, 2, 1, 3, 4).reshape(b, s, heads, d)


def _kernels(variants: dict, calls: int = 10) -> list:
    """Markdown rows: each variant's kernels (profiled over ``calls`` calls) with their GPU ms per call."""
    from torch.profiler import ProfilerActivity, profile
    from record import at_power_limit
    rows = []
    for name, fn in variants.items():
        at_power_limit(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0)):
            ms = getattr(e, "device_time_total", 0) / 1000 / calls
            if ms >= 0.002:
                rows.append(f"| {name} | {e.key[:90]} | {e.count / calls:g} | {ms:.4f} |")
    return rows


def attention_inputs(b=16, s=2048, h=32, g=8, d=64):
    """llama-1b's attention backward inputs on the GPU, as the model holds them ([b, s, heads, d] views of
    sequence-first storage): (q, k, v, scale, out, lse, dout), the forward by the model's op."""
    from paratron.model import flash_attention as fa
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(s, b, h, d, device=dev, dtype=bf16).transpose(0, 1)
    k, v = (torch.randn(s, b, g, d, device=dev, dtype=bf16).transpose(0, 1) for _ in range(2))
    scale = d ** -0.5
    out, lse = fa._fwd(q, k, v, scale)
    return q, k, v, scale, out, lse, torch.randn(s, b, h, d, device=dev, dtype=bf16).transpose(0, 1)


def main() -> None:
    from record import at_power_limit, cuda_median_ms, write_record
    from paratron.model import flash_attention as fa
    b, s, h, g, d = 16, 2048, 32, 8, 64
    q, k, v, scale, out, lse, dout = attention_inputs(b, s, h, g, d)
    ref = tuple(fa._seq_first_like(t) for t in (q, k, v))
    fa._bwd_into(dout, q, k, v, out, lse, scale, *ref)
    dk, dv = (fa._seq_first_like(t) for t in (k, v))
    rows = []
    for order in (True, False):
        dq = packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, order)
        for name, mine, theirs in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
            diff = (mine.float() - theirs.float()).abs().max().item()
            rel = diff / theirs.float().abs().max().item()
            rows.append(f"| {name} ({'longest first' if order else 'plain order'}) | {diff:.3g} | {rel:.3g} |")
            print(rows[-1], flush=True)
    times = []
    for name, fn in (("FlashAttention-4 (grouped)", lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref)),
                     ("packed rows, longest first", lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv)),
                     ("packed rows, plain order", lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, False)),
                     ("FlashAttention-4 (grouped), again", lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref))):
        at_power_limit(fn)
        times.append(f"| {name} | {cuda_median_ms(fn):.4f} |")
        print(times[-1], flush=True)
    kr, vr = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
    rep = tuple(fa._seq_first_like(t) for t in (q, kr, vr))
    kernels = _kernels({"grouped": lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref),
                        "repeated to 32 heads": lambda: fa._bwd_into(dout, q, kr, vr, out, lse, scale, *rep),
                        "packed, longest first": lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv)})
    body = "\n".join([f"b {b}, s {s}, {h} query heads, {g} groups, d {d}, causal; median of 20 after 1.5 s at the "
                      "power limit.", "", "| gradient | max abs diff vs FlashAttention-4 | relative to its max |",
                      "|---|---|---|", *rows, "", "| backward | ms |", "|---|---|", *times, "",
                      "Kernels (torch profiler, 10 calls each after 1.5 s at the power limit):", "",
                      "| variant | kernel | launches per call | GPU ms per call |", "|---|---|---|---|", *kernels])
    print(body)
    write_record(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results", "packed_gqa_bwd",
                 "FlashAttention-4's backward with packed query heads", torch.cuda.get_device_name(), {}, body)


if __name__ == "__main__":
    main()
