"""What grouped keys cost FlashAttention-4's backward at llama-1b's shape: the backward with the 8 key / value
heads as they are (fp32 dK / dV accumulators zero-filled, added to by every query head of a group, then
converted) against the same backward with keys and values repeated to 32 heads (dK / dV written directly; the
group sums would then be one more pass, timed too). Sizes the "packed GQA" backward for the next round.

    python benchmarks/gqa_bwd_probe.py        (on the device: . benchmarks/quack_env.sh first)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import at_power_limit, cuda_median_ms, write_record  # noqa: E402
from paratron.model import flash_attention as fa  # noqa: E402
from packed_gqa_bwd import attention_inputs  # noqa: E402


def main() -> None:
    b, s, h, g, d = 16, 2048, 32, 8, 64
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    q, k, v, scale, out, lse, dout = attention_inputs(b, s, h, g, d)
    rows = []
    for name, kk, vv in (("grouped (8 kv heads)", k, v),
                         ("repeated to 32 heads", *(t.repeat_interleave(h // g, dim=2) for t in (k, v)))):
        grads = tuple(fa._seq_first_like(t) for t in (q, kk, vv))

        def bwd(kk=kk, vv=vv, grads=grads):
            fa._bwd_into(dout, q, kk, vv, out, lse, scale, *grads)
        at_power_limit(bwd)
        rows.append(f"| {name} | {cuda_median_ms(bwd):.4f} |")
        print(rows[-1], flush=True)
    dk32 = torch.randn(b, s, h, d, device=dev, dtype=bf16)
    red = cuda_median_ms(lambda: dk32.view(b, s, g, h // g, d).sum(3, dtype=torch.float32).to(bf16))
    rows.append(f"| the group sum of one repeated gradient (dK or dV) | {red:.4f} |")
    body = "\n".join([f"FlashAttention-4 backward (pre + main + post), b {b}, s {s}, {h} query heads, {g} groups, "
                      f"d {d}, causal; median of 20 after 1.5 s at the power limit.", "",
                      "| keys / values | ms |", "|---|---|", *rows])
    print(body)
    write_record(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results", "gqa_bwd_probe",
                 "FlashAttention-4's backward with grouped against repeated keys", torch.cuda.get_device_name(),
                 {}, body)


if __name__ == "__main__":
    main()
