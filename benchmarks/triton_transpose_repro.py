"""A stand-alone reproducer of the Triton miscompile that made paratron's FP8 cast kernels write their
transposed copy from the bytes they just stored, read back after a barrier (paratron/parallel/fp8_mlp.py,
``_store_transposed``), instead of from the FP8 values in registers.

A kernel that loads two bf16 tiles (SwiGLU's gate and up halves), computes one FP8 tile from them and
stores it row-major and transposed writes wrong bytes in about a quarter (64 x 64 tiles, 4 warps) to
three eighths (128 x 64, 8 warps) of the transposed copy under Triton 3.6 (torch 2.11, H100 and H200,
2026-11-25); storing the transposed tile first makes it a half. The row-major copy is exact. A kernel
that only loads an FP8 tile and stores it transposed is exact.

    python benchmarks/triton_transpose_repro.py     # prints the fraction of wrong bytes per variant
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _two_loads_two_stores(h_ptr, q_ptr, qt_ptr, M, F, ORDER: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rf = tl.program_id(1) * BF + tl.arange(0, BF)
    base = h_ptr + rm[:, None].to(tl.int64) * (2 * F) + rf[None, :]
    gate = tl.load(base).to(tl.float32)
    up = tl.load(base + F).to(tl.float32)
    q = tl.clamp(gate * tl.sigmoid(gate) * up * 37.5, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    row = q_ptr + rm[:, None].to(tl.int64) * F + rf[None, :]
    col = qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :]
    if ORDER == 0:
        tl.store(row, q)
        tl.store(col, tl.trans(q))
    else:
        tl.store(col, tl.trans(q))
        tl.store(row, q)


@triton.jit
def _transpose_only(q_ptr, qt_ptr, M, F, BM: tl.constexpr, BF: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rf = tl.program_id(1) * BF + tl.arange(0, BF)
    q = tl.load(q_ptr + rm[:, None].to(tl.int64) * F + rf[None, :])
    tl.store(qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q))


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    m, f = 8192, 4096
    h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    gate, up = h.float().chunk(2, dim=1)
    ref = (torch.nn.functional.silu(gate) * up * 37.5).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    ref_t = ref.t().contiguous()
    for bm, bf, warps in ((64, 64, 4), (128, 64, 8), (32, 256, 4)):
        for order in (0, 1):
            q = torch.zeros(m, f, dtype=torch.float8_e4m3fn, device="cuda")
            qt = torch.zeros(f, m, dtype=torch.float8_e4m3fn, device="cuda")
            _two_loads_two_stores[(m // bm, f // bf)](h, q, qt, m, f, ORDER=order, BM=bm, BF=bf, num_warps=warps)
            torch.cuda.synchronize()
            print(f"two loads, {'row-major first' if order == 0 else 'transposed first'}, {bm}x{bf} w{warps}: "
                  f"row-major wrong {(q.view(torch.uint8) != ref).float().mean().item():.3f}, "
                  f"transposed wrong {(qt.view(torch.uint8) != ref_t).float().mean().item():.3f}")
        qt = torch.zeros(f, m, dtype=torch.float8_e4m3fn, device="cuda")
        _transpose_only[(m // bm, f // bf)](ref.view(torch.float8_e4m3fn), qt, m, f, BM=bm, BF=bf, num_warps=warps)
        torch.cuda.synchronize()
        print(f"transpose only, {bm}x{bf} w{warps}: wrong {(qt.view(torch.uint8) != ref_t).float().mean().item():.3f}")


if __name__ == "__main__":
    main()
