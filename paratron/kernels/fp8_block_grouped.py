"""The routed experts' grouped GEMMs with blockwise-scaled FP8 operands, in Triton (``--fp8-recipe blockwise``):
the forward ``x_e w_e^T`` and the input gradient ``g_e w_e``, both in one form (``--kernel-fp8-block-grouped-gemm
triton``), and the weight gradient ``g_e^T x_e``, summed along each expert's rows (``--kernel-fp8-block-grouped-wgrad
triton``, :func:`block_grouped_wgrad`). torch has no grouped GEMM with 1 x 128 / 128 x 128 scales, so the
``dequant`` path of kernels/fp8_grouped.py dequantises both operands to bf16 first; these kernels multiply the FP8
tiles themselves.

Operands: ``a`` [S, K] e4m3, rows sorted by expert with each expert's rows starting at a multiple of 128 (so a tile
of 128 rows holds one expert's rows), a scale per 1 x 128 tile along K (``sa`` [S, ceil(K/128)]); ``b`` [E, N, K]
e4m3, each expert's [N, K] with a scale per 128 x 128 block (``sb`` [E N/128, ceil(K/128)], ``b`` viewed [E N, K];
N a multiple of 128); ``ends`` [E] int32, each expert's end row. A program computes a 128 x 128 tile of the output:
its expert is the number of ends at or before its first row; for each 128-wide step along K it multiplies the two
FP8 tiles on the tensor cores into fp32 and adds the product divided by the step's two scales (a scale is what the
values were multiplied by before the cast: kernels/fp8_block.py), DeepSeek-V3's recipe. Rows at or past the last
end come out zero. The scales and the rows' layout are the ``dequant`` path's, so the two give the same numbers up
to the order of the sums (``tests/unit/test_fp8_block_grouped.py`` checks the kernel against the dequantised
product through Triton's CPU interpreter).
"""
from __future__ import annotations

import contextlib

import torch

from .experimental import deepgemm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

TILE = 128  # rows, columns and summed positions of one program's step (the recipe's tile and block)


def wgrad_choice(device) -> tuple[str, str]:
    """What ``--kernel-fp8-block-grouped-wgrad auto`` runs on ``device``, and why."""
    return "dequant", "not yet measured against the dequant path on a GPU (docs/moe.md)"


def gemm_choice(device) -> tuple[str, str]:
    """What ``--kernel-fp8-block-grouped-gemm auto`` runs on ``device``, and why: DeepGEMM's grouped GEMM where the
    pinned build is installed (moe-mini's blockwise step measured faster with it than with dequant: docs/moe.md
    "Speed"); else dequant, paratron's Triton kernel having made that step slower."""
    if deepgemm.refusal(device) is None:
        return "deepgemm", f"DeepGEMM {deepgemm.VERSION} installed: faster than the dequant path (docs/moe.md)"
    return "dequant", ("measured: moe-mini's blockwise step is slower with the Triton kernel "
                       "(benchmarks/results/train_throughput_moe-mini_20261204_123107.md)")


if triton is not None:
    @triton.jit
    def _block_grouped_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, c_ptr, S, N, K, E,
                              sam, sak, ssam, ssak, sbe, sbn, sbk, ssbr, ssbk, scm, scn,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        m0 = pid_m * BM
        experts = tl.arange(0, EP)
        ends = tl.load(ends_ptr + experts, mask=experts < E, other=2147483647)
        e = tl.sum((ends <= m0).to(tl.int32))  # the expert of rows [m0, m0 + BM)
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)  # (offsets past 2**31 on large expert batches)
        cols = pid_n * BN + tl.arange(0, BN)
        live_r, live_c = rows < S, cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        if e < E:
            e64 = e.to(tl.int64)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                live_k = ks < K
                a = tl.load(a_ptr + rows[:, None] * sam + ks[None, :] * sak, mask=live_r[:, None] & live_k[None, :],
                            other=0.0)
                b = tl.load(b_ptr + e64 * sbe + cols[:, None] * sbn + ks[None, :] * sbk,
                            mask=live_c[:, None] & live_k[None, :], other=0.0)
                part = tl.dot(a, tl.trans(b))
                kb = k0 // BK
                s_a = tl.load(sa_ptr + rows * ssam + kb * ssak, mask=live_r, other=1.0)
                s_b = tl.load(sb_ptr + (e64 * (N // BN) + pid_n) * ssbr + kb * ssbk)
                acc += part * (1.0 / (s_a * s_b))[:, None]  # (a divide per row, not per element)
        tl.store(c_ptr + rows[:, None] * scm + cols[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
                 mask=live_r[:, None] & live_c[None, :])

    @torch.library.custom_op("paratron::fp8_block_grouped_mm", mutates_args=())
    def block_grouped_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, ends: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        """``a``'s rows of expert e times ``b[e]``^T, [S, N] in ``out_dtype`` (the module docstring's operands)."""
        s, k = a.shape
        e, n, _ = b.shape
        if n % TILE:
            raise ValueError(f"the blockwise grouped GEMM needs N in multiples of {TILE} (got {n})")
        out = torch.empty(s, n, device=a.device, dtype=out_dtype)
        if not out.numel():
            return out
        ends = ends.to(torch.int32).contiguous()
        with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
            _block_grouped_kernel[(triton.cdiv(s, TILE), n // TILE)](
                a, sa, b, sb, ends, out, s, n, k, e, a.stride(0), a.stride(1), sa.stride(0), sa.stride(1),
                b.stride(0), b.stride(1), b.stride(2), sb.stride(0), sb.stride(1), out.stride(0), out.stride(1),
                BM=TILE, BN=TILE, BK=TILE, EP=max(16, triton.next_power_of_2(e)), num_warps=8, num_stages=3)
        return out

    @block_grouped_mm.register_fake
    def _(a, sa, b, sb, ends, out_dtype):
        return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)

    @triton.jit
    def _block_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, c_ptr, N, K,
                            san, sas, ssan, ssas, sbk, sbs, ssbk, ssbs, sce, scn, sck,
                            BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
        """Program (n, k, e): the [BM, BN] tile of expert e's ``g_e^T x_e`` from ``a`` = g^T [N, S] and ``b`` =
        x^T [K, S], summed over e's rows 128 at a time; each step's FP8 product divided by the row scales of its
        two tiles (one per row of a and of b: the 1 x 128 tiles along S)."""
        pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        rows = (pid_n * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_k * BN + tl.arange(0, BN)).to(tl.int64)
        live_r, live_c = rows < N, cols < K
        acc = tl.zeros([BM, BN], tl.float32)
        # (the experts' rows start at multiples of 128: said, so that the loads vectorise and are pipelined)
        start = tl.multiple_of(start, BS)
        for t0 in range(start, end, BS):
            ts = t0 + tl.arange(0, BS)
            a = tl.load(a_ptr + rows[:, None] * san + ts[None, :] * sas, mask=live_r[:, None], other=0.0)
            b = tl.load(b_ptr + cols[:, None] * sbk + ts[None, :] * sbs, mask=live_c[:, None], other=0.0)
            part = tl.dot(a, tl.trans(b))
            tb = t0 // BS
            s_a = tl.load(sa_ptr + rows * ssan + tb * ssas, mask=live_r, other=1.0)
            s_b = tl.load(sb_ptr + cols * ssbk + tb * ssbs, mask=live_c, other=1.0)
            acc += part * (1.0 / s_a)[:, None] * (1.0 / s_b)[None, :]
        out = c_ptr + e.to(tl.int64) * sce + rows[:, None] * scn + cols[None, :] * sck
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=live_r[:, None] & live_c[None, :])

    @torch.library.custom_op("paratron::fp8_block_grouped_wgrad", mutates_args=())
    def block_grouped_wgrad(gt: torch.Tensor, sg: torch.Tensor, xt: torch.Tensor, sx: torch.Tensor,
                            ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's weight gradient ``g_e^T x_e`` [E, N, K] from ``gt`` = g^T [N, S] and ``xt`` = x^T [K, S]
        in e4m3 with a scale per 1 x 128 tile along S (``sg`` [N, S/128], ``sx`` [K, S/128]); ``ends`` [E] int32,
        each a multiple of 128 (an expert's rows never share a tile with another's). An expert without rows gets
        zeros."""
        n, s = gt.shape
        k = xt.shape[0]
        e = ends.numel()
        out = torch.empty(e, n, k, device=gt.device, dtype=out_dtype)
        if not out.numel():
            return out
        ends = ends.to(torch.int32).contiguous()
        with torch.cuda.device(gt.device) if gt.is_cuda else contextlib.nullcontext():
            _block_wgrad_kernel[(triton.cdiv(n, TILE), triton.cdiv(k, TILE), e)](
                gt, sg, xt, sx, ends, out, n, k, gt.stride(0), gt.stride(1), sg.stride(0), sg.stride(1),
                xt.stride(0), xt.stride(1), sx.stride(0), sx.stride(1), out.stride(0), out.stride(1), out.stride(2),
                BM=TILE, BN=TILE, BS=TILE, num_warps=8, num_stages=3)
        return out

    @block_grouped_wgrad.register_fake
    def _(gt, sg, xt, sx, ends, out_dtype):
        return gt.new_empty(ends.numel(), gt.shape[0], xt.shape[0], dtype=out_dtype)
