"""Which SDPA kernel runs for the benchmark shapes, and how fast each backend is (one GPU).

    python benchmarks/sdpa_check.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import cuda_ms  # noqa: E402  (benchmarks/record.py)

SHAPES = {"gpt-350m": (8, 16, 16, 2048, 64), "llama-1b": (4, 32, 8, 2048, 64)}  # b, heads, kv heads, s, d


def bench(fn, iters: int = 20) -> float:
    return cuda_ms(fn, iters)


def flex_attention_ms(q, k, v):
    """FlexAttention (compiled, causal block mask) fwd+bwd time, or None when it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        s = q.shape[2]
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device="cuda")
        flex = torch.compile(flex_attention)

        def step():
            out = flex(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
            out.sum().backward()
        return bench(step)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"flex attention failed: {str(e).splitlines()[0][:120]}")
        return None


def main():
    for name, (b, h, kv, s, d) in SHAPES.items():
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for mode in ("enable_gqa", "expand"):
                if kv == h and mode == "expand":
                    continue

                def step():
                    kk, vv = (k, v) if mode == "enable_gqa" else (k.repeat_interleave(h // kv, 1),
                                                                  v.repeat_interleave(h // kv, 1))
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                         enable_gqa=(kv != h and mode == "enable_gqa"))
                    out.sum().backward()
                try:
                    with sdpa_kernel([backend]):
                        ms = bench(step)
                    print(f"{name:9s} {backend.name:20s} {mode:10s} fwd+bwd {ms:7.2f} ms")
                except Exception as e:
                    print(f"{name:9s} {backend.name:20s} {mode:10s} unavailable: {str(e).splitlines()[0][:90]}")
        flex_ms = flex_attention_ms(q, k, v)
        causal_tflop = 3.5 * 2 * b * h * s * s * d / 1e12  # fwd (2 matmuls, half the square) + bwd (2.5x)
        print(f"{name:9s} {'FLEX_ATTENTION':20s} {'enable_gqa':10s} fwd+bwd {flex_ms:7.2f} ms" if flex_ms
              else f"{name:9s} FLEX_ATTENTION unavailable")
        print(f"{name:9s} causal fwd+bwd work {causal_tflop:.3f} TFLOP per call (divide by the ms above)")
    q = torch.randn(4, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 8, 2048, 64, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print("default kernel(s) for GQA llama-1b shape:", [n[:80] for n in names])


if __name__ == "__main__":
    main()
