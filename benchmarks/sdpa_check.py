"""Which SDPA kernel runs for the benchmark shapes, and how fast each backend is (one GPU).

    python benchmarks/sdpa_check.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"gpt-350m": (8, 16, 16, 2048, 64), "llama-1b": (4, 32, 8, 2048, 64)}  # b, heads, kv heads, s, d


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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
    q = torch.randn(4, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 8, 2048, 64, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print("default kernel(s) for GQA llama-1b shape:", [n[:80] for n in names])


if __name__ == "__main__":
    main()
