"""Forward + backward time of one attention core (SDPA) with Megatron's variants on a GPU: plain
causal, learnable sinks, a sliding window, both (docs/attention.md). gpt-oss-20b's shape by default.

    python benchmarks/attention_variants_bench.py [--seq 4096] [--batch 1] [--heads 64] [--groups 8] [--dim 64]

Prints one line per variant: milliseconds per forward + backward (median of 20 after 5 warm-up runs).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from paratron.config import ModelConfig
from paratron.model.core_attention import CoreAttention
from paratron.model.layers import ForwardContext, Parallel

VARIANTS = {"causal": (None, "vanilla"), "sinks": (None, "learnable"), "window 128": ("127,0", "vanilla"),
            "window 128 + sinks": ("127,0", "learnable")}


def time_variant(args, window, softmax_type) -> float:
    cfg = ModelConfig(num_layers=1, hidden_size=args.heads * args.dim, num_attention_heads=args.heads,
                      group_query_attention=True, num_query_groups=args.groups, seq_length=args.seq,
                      window_size=window, softmax_type=softmax_type).resolved()
    core = CoreAttention(cfg, Parallel(), 0, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(args.batch, n, args.seq, args.dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for n in (args.heads, args.groups, args.groups))
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        core(q, k, v, ForwardContext()).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("seq", 4096), ("batch", 1), ("heads", 64), ("groups", 8), ("dim", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} seq {args.seq} batch {args.batch} "
          f"heads {args.heads} groups {args.groups} dim {args.dim}")
    for name, (window, softmax_type) in VARIANTS.items():
        print(f"{name:>20}: {time_variant(args, window, softmax_type):8.2f} ms forward + backward")


if __name__ == "__main__":
    main()
