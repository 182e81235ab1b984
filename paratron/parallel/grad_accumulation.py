"""Micro-batch gradients into the fp32 ``main_grad`` buffers (paratron/parallel/data.py).

Two ways. (1) After autograd has put a parameter's gradient of one micro-batch in ``param.grad``, the
data-parallel hook adds it to ``main_grad`` (``accumulate_``: one vectorised Triton pass on CUDA). (2)
Megatron's gradient-accumulation fusion (on unless ``--no-gradient-accumulation-fusion``): the linear
layers' weight-gradient GEMM adds ``dY^T X`` straight into ``main_grad`` (cuBLAS with an fp32 output
accumulating in place: ``torch.addmm(..., out_dtype=torch.float32)``), so the bf16 gradient is never
written, read back and added. At the H100's power limit, where the training step runs, that GEMM ran at
691 against 706 TFLOP/s for the plain bf16 one, and 677 for the bf16 GEMM plus the Triton add
(benchmarks/results/gemm_power_20261126_0915.md).

Which weights take (2): those a layer marked ``wgrad_fusable`` (every training use of the weight goes
through ``linear`` below or the gated MLP's own backward, which both honour the mark) whose layer has
no FP8 state; ``DataParallel`` then sets ``param.fuse_wgrad`` and skips them in its hook. Autograd still
gets a gradient for each of them (an uninitialised placeholder: its allocation is all it costs), so the
hooks that count a bucket's gradients (--overlap-grad-reduce) run as before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cublaslt, quack_gemm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ACC_BLOCK = 4096  # elements per program of the accumulation kernels


def accumulate_(acc: Tensor, grad: Tensor, write: bool, fused: bool = True) -> None:
    """``acc = grad`` (``write``) or ``acc += grad``: a micro-batch gradient into its ``main_grad``. With
    ``fused``, for fp32 ``acc`` and a bf16/fp16 ``grad`` (contiguous, same shape) on CUDA, one vectorised
    Triton pass: torch's mixed-dtype copy_ / add_ run its unvectorised casting loop (about half the memory
    bandwidth; 8.8 ms per 65,536 tokens on llama-1b at two micro-batches). Otherwise torch's copy_ / add_."""
    if (fused and triton is not None and acc.is_cuda and acc.dtype == torch.float32
            and grad.dtype in (torch.bfloat16, torch.float16)
            and acc.is_contiguous() and grad.is_contiguous() and acc.shape == grad.shape):
        n = acc.numel()
        with torch.cuda.device(acc.device):
            _accumulate[(triton.cdiv(n, ACC_BLOCK),)](acc, grad, n, WRITE=write, BLOCK=ACC_BLOCK)
    elif write:
        acc.copy_(grad)
    else:
        acc.add_(grad)


def accumulate_deinterleaved_(acc: Tensor, grad: Tensor) -> None:
    """``acc += grad`` with ``grad``'s rows interleaved ([g0, u0, g1, u1, ...]) and ``acc``'s in halves
    ([gate; up]): the gated MLP's fc1 weight gradient, which its GEMMs produce interleaved. One Triton pass
    on CUDA (contiguous fp32 ``acc``, bf16/fp16 ``grad``); torch's strided add elsewhere."""
    rows = acc.size(0)
    if (triton is not None and acc.is_cuda and acc.dtype == torch.float32 and grad.dtype != torch.float32
            and acc.is_contiguous() and grad.is_contiguous() and acc.shape == grad.shape and rows % 2 == 0):
        cols = acc.numel() // rows
        with torch.cuda.device(acc.device):
            _accumulate_deinterleaved[(rows, triton.cdiv(cols, ACC_BLOCK))](acc, grad, rows // 2, cols,
                                                                           BLOCK=ACC_BLOCK)
    else:
        acc.view(2, rows // 2, -1).add_(grad.reshape(rows // 2, 2, -1).transpose(0, 1))


if triton is not None:
    @triton.jit
    def _accumulate(acc_ptr, g_ptr, n, WRITE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if not WRITE:
            g += tl.load(acc_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, g, mask=mask)

    @triton.jit
    def _accumulate_deinterleaved(acc_ptr, g_ptr, half, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # destination row: [gate; up] order
        src = (row % half) * 2 + row // half  # its row in the interleaved gradient
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        dst = acc_ptr + row.to(tl.int64) * cols + offs
        g = tl.load(g_ptr + src.to(tl.int64) * cols + offs, mask=mask).to(tl.float32)
        tl.store(dst, tl.load(dst, mask=mask) + g, mask=mask)


# ---- the fused weight gradient -----------------------------------------------------------------------
@torch.library.custom_op("paratron::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: Tensor, dy: Tensor, x: Tensor, interleaved: bool) -> None:
    """``main_grad += dy^T @ x`` (``dy`` [tokens, out], ``x`` [tokens, in]); with ``interleaved`` the
    product's rows are the gated MLP's interleaved order and are added to ``main_grad``'s [gate; up]
    halves. A custom op so that a compiled backward keeps it as one opaque node mutating the buffer."""
    if interleaved:
        accumulate_deinterleaved_(main_grad, dy.t() @ x)
    elif main_grad.dtype == dy.dtype or not main_grad.is_cuda:  # (CPUs: the product in the buffer's dtype)
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))
    else:  # bf16 operands, fp32 output accumulating in place
        torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)


@wgrad_accumulate.register_fake
def _wgrad_accumulate_fake(main_grad, dy, x, interleaved):
    return None


class _FusedLinear(torch.autograd.Function):
    """``x W^T (+ b) (+ residual)`` whose backward adds W's gradient to ``main_grad`` itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad  # (not saved: its version changes as it accumulates, by design)
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        return _plain(x, weight, bias, residual, training=True)  # (autograd is off inside forward)

    @staticmethod
    def backward(ctx, dy):
        (x, weight), main_grad = ctx.saved_tensors, ctx.main_grad
        dy2 = dy.reshape(-1, dy.size(-1))
        wgrad_accumulate(main_grad, dy2, x.reshape(-1, x.size(-1)), False)
        dbias = dy2.sum(0).to(weight.dtype) if ctx.has_bias else None
        dx = cublaslt.mm(dy2, weight.t()).view(*dy.shape[:-1], weight.size(1))  # cuBLAS or cuBLASLt, the faster
        return (dx, torch.empty_like(weight), dbias, dy if ctx.has_residual else None, None)


def residual_addmm(c: Tensor, a: Tensor, weight: Tensor) -> Tensor:
    """``c + a W^T`` into a new tensor in training (the residual as the GEMM's C operand, not copied into the
    output first): quack's GEMM reading C where its ``residual`` tiles are on (quack_gemm.py), else cuBLASLt
    (cublaslt.py; torch's addmm where that does not run)."""
    if quack_gemm.residual_applies(a):
        return quack_gemm.gemm_add(c, a, weight, quack_gemm.tile("residual"))
    return cublaslt.addmm(c, a, weight)


def _plain(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
           training: Optional[bool] = None) -> Tensor:
    """``x W^T + b + residual``: the residual as the matmul's C operand when there is no bias (one row,
    as in batch-1 decoding, stays matmul + add, which a compiled step makes one GEMV kernel). In training
    ``residual_addmm`` (torch's addmm copies C into its output first). ``training``: None, autograd's state
    says."""
    if residual is not None and bias is None and x.numel() != x.size(-1):
        c, a = residual.reshape(-1, weight.size(0)), x.reshape(-1, x.size(-1))
        training = torch.is_grad_enabled() if training is None else training
        if training:  # (not in generation: its prompts' lengths vary, and cuBLASLt's choice is made per shape)
            return residual_addmm(c, a, weight).view(residual.shape)
        return torch.addmm(c, a, weight.t()).view(residual.shape)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``x W^T (+ b) (+ residual)``; with autograd on and W marked ``fuse_wgrad`` (by DataParallel), W's
    gradient goes straight into ``W.main_grad``."""
    main_grad = main_grad_of(weight)
    if main_grad is not None:
        return _FusedLinear.apply(x, weight, bias, residual, main_grad)
    return _plain(x, weight, bias, residual)


@torch.library.custom_op("paratron::embedding_accumulate", mutates_args=("main_grad",))
def embedding_accumulate(main_grad: Tensor, ids: Tensor, dy: Tensor) -> None:
    """``main_grad[ids[t]] += dy[t]`` for every token t (``ids`` [T], ``dy`` [T, h]): an embedding table's
    gradient. On CUDA outside --deterministic-mode one Triton pass of fp32 atomic adds (the order of the
    adds to a repeated token's row varies from run to run); elsewhere torch's embedding backward (sorted,
    deterministic) sums the rows first and the sum is added, as on the unfused path."""
    if (triton is not None and main_grad.is_cuda and main_grad.dtype == torch.float32 and dy.is_contiguous()
            and main_grad.is_contiguous() and not torch.are_deterministic_algorithms_enabled()):
        t, h = dy.shape
        with torch.cuda.device(main_grad.device):
            _embedding_accumulate[(t, triton.cdiv(h, EMB_BLOCK))](main_grad, ids, dy, h, BLOCK=EMB_BLOCK)
        return
    grad = torch.ops.aten.embedding_dense_backward(dy, ids, main_grad.size(0), -1, False)
    accumulate_(main_grad, grad, write=False)


@embedding_accumulate.register_fake
def _embedding_accumulate_fake(main_grad, ids, dy):
    return None


EMB_BLOCK = 1024  # columns per program of the embedding's accumulation

if triton is not None:
    @triton.jit
    def _embedding_accumulate(acc_ptr, ids_ptr, dy_ptr, h, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        row = tl.load(ids_ptr + t).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < h
        g = tl.load(dy_ptr + t.to(tl.int64) * h + offs, mask=mask).to(tl.float32)
        tl.atomic_add(acc_ptr + row * h + offs, g, mask=mask, sem="relaxed")


class _FusedEmbedding(torch.autograd.Function):
    """``weight[ids]`` whose backward adds the table's gradient to ``main_grad`` itself."""

    @staticmethod
    def forward(ctx, ids, weight, main_grad):
        ctx.save_for_backward(ids)
        ctx.main_grad, ctx.shape = main_grad, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        embedding_accumulate(ctx.main_grad, ids.reshape(-1), dy.reshape(-1, dy.size(-1)).contiguous())
        return None, dy.new_empty(ctx.shape), None


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """``F.embedding(ids, weight)``; with autograd on and the table marked ``fuse_wgrad`` (by DataParallel),
    its gradient goes straight into ``weight.main_grad``: no [vocab, h] gradient is zeroed, scattered,
    sorted and added (about 2 ms per 65,536 tokens on llama-1b)."""
    main_grad = main_grad_of(weight)
    if main_grad is not None:
        return _FusedEmbedding.apply(ids, weight, main_grad)
    return F.embedding(ids, weight)


def main_grad_of(weight: Tensor) -> Optional[Tensor]:
    """``weight.main_grad`` when its gradient is to be added there by the backward (``fuse_wgrad``), else
    None; for code with its own weight-gradient GEMMs (the gated MLP)."""
    return weight.main_grad if torch.is_grad_enabled() and getattr(weight, "fuse_wgrad", False) else None


def mark_fusable(*layers) -> None:
    """Say that every training use of these layers' weights (Column/RowParallelLinear, an untied
    VocabParallelEmbedding) goes through ``linear`` / ``embedding`` or honours ``main_grad_of``:
    DataParallel may then fuse their weight gradients."""
    for layer in layers:
        layer.weight.wgrad_fusable = True


def fusable_weights(module: torch.nn.Module) -> list:
    """The weights of ``module`` whose gradient accumulation can be fused: marked ``wgrad_fusable`` by
    their layer, trainable, and the layer without an FP8 state (FP8 matmuls have their own backward)."""
    return [m.weight for m in module.modules()
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.requires_grad
            and getattr(m.weight, "wgrad_fusable", False) and getattr(m, "fp8", None) is None]
