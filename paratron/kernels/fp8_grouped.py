"""Grouped GEMMs of FP8 operands: the routed experts' three matmuls (forward, input gradient, weight gradient)
over rows sorted by expert, each expert's rows starting at a multiple of the alignment (``ends``: the int32
end row of each expert, as ``torch._grouped_mm`` takes them).

Scales come in two kinds: ``tensor`` (one fp32 scale per operand: the tensorwise and delayed recipes) and
``block`` (kernels/fp8_block.py: 1 x 128 tiles along the summed dimension for activations and gradients,
128 x 128 blocks for each expert's weight). Paths (``--kernel-fp8-grouped-gemm``):

* ``scaled_grouped_mm``: ``torch._scaled_grouped_mm`` (Hopper), tensor scales only, given as the row /
  column scales it takes (the one scale repeated: the same products); it writes bf16 only, so an fp32 model's
  products are its bf16 results converted;
* ``dequant``: the FP8 operands dequantised to bf16 and multiplied by ``torch._grouped_mm`` (the recipe's
  numbers without FP8 speed; the path of block scales on every GPU, torch having no blockwise grouped GEMM);
* ``emulate``: dequantised to fp32 and multiplied by ``torch._grouped_mm`` in fp32 (the CPU tests' reference).
* ``triton`` (block scales, ``--kernel-fp8-block-grouped-gemm``): the forward and input gradient multiply the FP8
  tiles themselves (kernels/fp8_block_grouped.py); the weight gradient, summed along the rows, takes ``dequant``
  unless ``--kernel-fp8-block-grouped-wgrad triton`` asks for the Triton kernel that sums the tiles along the rows
  (given to :func:`grouped_wgrad` as its ``triton`` path, whatever the forward's).
* ``deepgemm`` (kernels/experimental/deepgemm.py; groups starting at multiples of 128): the forward and input
  gradient by DeepGEMM's grouped kernel, block scales as they are and tensor scales given as the same scale for
  every tile and block (it promotes each 128-deep partial sum to fp32, where torch's forward accumulates in the
  tensor cores' precision); the weight gradient by ``scaled_grouped_mm`` (tensor scales) or ``dequant`` (block).

None of them reads the group sizes on the host.
"""
from __future__ import annotations

import torch

from . import fp8_block_grouped  # noqa: F401 (registers paratron::fp8_block_grouped_mm where Triton is)
from .experimental import deepgemm
from .fp8_block import TILE, dequantize_blocks, dequantize_tiles
from .fp8_cast import dequantize

GROUPED_GEMMS = ("scaled_grouped_mm", "deepgemm", "dequant", "emulate")


def _deq(q: torch.Tensor, s: torch.Tensor, kind: str, blocks: bool, dtype: torch.dtype) -> torch.Tensor:
    if kind == "tensor":
        return dequantize(q, s, dtype)
    if not blocks:
        return dequantize_tiles(q, s, dtype)
    e, n, k = q.shape  # each expert's weight in 128 x 128 blocks (n a multiple of 128: blocks stay in one expert)
    return dequantize_blocks(q.reshape(e * n, k), s, dtype).view(e, n, k)


def _work_dtype(path: str, out_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if path == "emulate" else out_dtype


def grouped_forward(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, ends: torch.Tensor,
                    kind: str, out_dtype: torch.dtype, path: str, fast_accum: bool = False) -> torch.Tensor:
    """Rows of ``a`` [S, K] of expert e times ``b[e]``^T ([E, N, K]): [S, N]. Block scales: ``sa`` per
    1 x 128 tile of a's rows, ``sb`` per 128 x 128 block of ``b`` viewed [E N, K]. ``fast_accum``: torch's FP8
    kernel accumulates in the tensor cores' own precision, without promoting partial sums to fp32 (the forward
    GEMMs, as the dense layers' and Transformer Engine's; the gradients keep the promotion)."""
    if path == "scaled_grouped_mm":
        rows, cols = sa.reciprocal().expand(a.shape[0]), sb.reciprocal().expand(b.shape[0], b.shape[1])
        out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), rows.contiguous(), cols.contiguous(), offs=ends,
                                       out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
        return as_dtype(out, out_dtype)
    if path == "deepgemm":  # DeepGEMM's grouped kernel (kernels/experimental/deepgemm.py)
        if kind == "tensor":  # one scale a tensor, given as the same scale for every tile and block
            sa, sb = tensor_scales_as_blocks(sa, sb, a.shape, b.shape)
        return deepgemm.grouped_mm(a, sa, b, sb, ends, out_dtype)
    if path == "triton":  # block scales: the FP8 tiles multiplied as they are (kernels/fp8_block_grouped.py)
        return torch.ops.paratron.fp8_block_grouped_mm(a, sa, b, sb, ends, out_dtype)
    dt = _work_dtype(path, out_dtype)
    out = dequant_grouped_mm(_deq(a, sa, kind, False, dt), _deq(b, sb, kind, True, dt).transpose(-2, -1), ends)
    return as_dtype(out, out_dtype)


def grouped_wgrad(gt: torch.Tensor, sg: torch.Tensor, xt: torch.Tensor, sx: torch.Tensor, ends: torch.Tensor,
                  kind: str, out_dtype: torch.dtype, path: str) -> torch.Tensor:
    """Each expert's ``g_e^T x_e`` [E, N, K] from ``gt`` = g^T [N, S] and ``xt`` = x^T [K, S] (block scales: 1 x 128
    tiles along S, which never straddle two experts when each expert's rows start at a multiple of 128).
    ``dequant`` (bf16 ``torch._grouped_mm``) gives the kernel its operands in the layout of the weight gradient
    of torch's own bf16 grouped GEMM (g^T column-major, x row-major: the dequantising pass writes them so under
    the compiler) rather than both K-major, a layout no other path used, and sets the gradient of an expert that
    got no rows to zero itself: torch's Hopper grouped GEMM does not promise to write an empty group's output (its
    Blackwell setup refuses such groups in every layout but the former)."""
    groups = ends.numel()
    if path == "triton" and kind == "block":  # the FP8 tiles summed along the rows (kernels/fp8_block_grouped.py)
        return torch.ops.paratron.fp8_block_grouped_wgrad(gt, sg, xt, sx, ends, out_dtype)
    # (DeepGEMM's grouped weight gradient on Hopper takes the experts' row counts on the host, a read-back per
    # layer: tensor scales take torch's grouped FP8 GEMM, block scales the dequant path)
    if path == "deepgemm":
        path = "scaled_grouped_mm" if kind == "tensor" else "dequant"
    if path == "scaled_grouped_mm":
        rows = sg.reciprocal().expand(groups * gt.shape[0]).contiguous()
        cols = sx.reciprocal().expand(groups * xt.shape[0]).contiguous()
        out = torch._scaled_grouped_mm(gt, xt.t(), rows, cols, offs=ends, out_dtype=torch.bfloat16)
        return as_dtype(out, out_dtype)
    dt = _work_dtype(path, out_dtype)
    a, b = _deq(gt, sg, kind, False, dt), _deq(xt, sx, kind, False, dt).t()
    if path == "dequant":  # the operands in the layout of torch's own weight gradient (column-, then row-major)
        a, b = a.t().contiguous().t(), b.contiguous()
    out = dequant_grouped_mm(a, b, ends)
    if path == "dequant":  # an expert with no rows: its gradient is zero, whatever the kernel left there
        out = torch.where((torch.diff(ends, prepend=ends.new_zeros(1)) > 0)[:, None, None], out, 0.0)
    return as_dtype(out, out_dtype)


def tensor_scales_as_blocks(sa: torch.Tensor, sb: torch.Tensor, a_shape, b_shape) -> tuple:
    """The tensor scales of ``a`` [S, K] and of the experts' ``b`` [E, N, K] as the block-scaled layout's: the same
    scale for each 1 x 128 tile of ``a``'s rows ([S, K/128]) and each 128 x 128 block of ``b`` viewed [E N, K]
    ([E N/128, K/128]); a GEMM that applies them per block gives the tensorwise product (each partial sum over 128
    of K scaled by the same factor)."""
    (s, k), (e, n, _) = a_shape, b_shape
    return (sa.reshape(1, 1).expand(s, -(-k // TILE)).contiguous(),
            sb.reshape(1, 1).expand(e * (n // TILE), -(-k // TILE)).contiguous())


def as_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``, never ``out.to(out.dtype)``: that returns ``out`` itself, and torch 2.11's compiler
    then traced the autograd function returning it with a zero output gradient (the experts' weight and input
    gradients came out zero under --torch-compile; fixed in later torch). Every traced path of this module
    returns through it (tests/unit/test_fp8_experts.py checks that none calls ``.to`` to the dtype it has)."""
    return out if out.dtype == dtype else out.to(dtype)


@torch.library.custom_op("paratron::fp8_dequant_grouped_mm", mutates_args=())
def dequant_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=ends)`` as an operator of its own, so that torch.compile calls torch's
    kernel on the operands as laid out here instead of lowering the GEMM itself (the ``dequant`` and ``emulate``
    paths: torch.compile's meta function of ``torch._grouped_mm`` takes bf16 only, and the emulation's are fp32)."""
    return torch._grouped_mm(a, b, offs=ends)


@dequant_grouped_mm.register_fake
def _(a, b, ends):
    if a.dim() == 2 and b.dim() == 2:
        return a.new_empty(ends.numel(), a.shape[0], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])


def align_for(kind: str) -> int:
    """The row alignment of each expert's group: 128 for block scales (whole tiles per expert), else 16."""
    return TILE if kind == "block" else 16


def gemm_choice(device) -> tuple[str, str]:
    """What ``--kernel-fp8-grouped-gemm auto`` runs on ``device``, and why."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "dequant", "needs CUDA (Hopper)"
    if not hasattr(torch, "_scaled_grouped_mm") or torch.cuda.get_device_capability(dev) != (9, 0):
        return "dequant", "torch._scaled_grouped_mm runs on Hopper (sm90)"
    return "scaled_grouped_mm", "torch._scaled_grouped_mm on Hopper (tensorwise / delayed recipes)"
