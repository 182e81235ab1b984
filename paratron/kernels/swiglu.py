"""Hand-written GPU kernels for bandwidth-bound steps that torch.compile fuses poorly.

SwiGLU: ``silu(gate) * up`` of the fused fc1 output ``h = [gate | up]`` (last dimension 2F). Its
backward writes d/dgate and d/dup into the two halves of one [.., 2F] gradient; Inductor lowers
that concatenation as a pointwise kernel over the 2F outputs in which each half re-reads the
inputs it shares with the other (5 reads + 2 writes of an F-wide tensor per token instead of
3 + 2). The Triton kernel here walks the F columns once and stores both halves. On an H100 at
llama-1b's shape it runs near the memory bandwidth, and SwiGLU forward + backward took less of the step per
token than with Inductor's kernels (benchmarks/results/perf_notes.md, its third session's table).

The kernels are ``torch.library`` custom ops with autograd, so a compiled layer calls them as
opaque nodes. They run on CUDA when Triton is importable; everywhere else (CPU, no Triton)
``swiglu`` is the plain torch expression, which is also the reference in the tests.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 1024  # columns per program (the last block of a row is masked)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate | up]`` along the last dimension."""
    if triton is not None and h.is_cuda and h.is_contiguous():
        return torch.ops.paratron.swiglu(h)
    return swiglu_reference(h)


if triton is not None:
    @triton.jit
    def _swiglu_fwd(h_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(h_ptr + row * 2 * n_cols + cols, mask=mask).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * n_cols + n_cols + cols, mask=mask).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(h_ptr, dout_ptr, dh_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(h_ptr + row * 2 * n_cols + cols, mask=mask).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * n_cols + n_cols + cols, mask=mask).to(tl.float32)
        dout = tl.load(dout_ptr + row * n_cols + cols, mask=mask).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
        dup = dout * silu
        tl.store(dh_ptr + row * 2 * n_cols + cols, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + row * 2 * n_cols + n_cols + cols, dup.to(dh_ptr.dtype.element_ty), mask=mask)

    def _grid(h: torch.Tensor):
        n_cols = h.size(-1) // 2
        return (h.numel() // h.size(-1), triton.cdiv(n_cols, BLOCK)), n_cols

    def _on(t: torch.Tensor):  # launch on the tensor's GPU (CPU: Triton's interpreter, in tests)
        return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

    @torch.library.custom_op("paratron::swiglu", mutates_args=())
    def _swiglu_op(h: torch.Tensor) -> torch.Tensor:
        grid, n_cols = _grid(h)
        out = h.new_empty(*h.shape[:-1], n_cols)
        if out.numel():
            with _on(h):
                _swiglu_fwd[grid](h, out, n_cols, BLOCK=BLOCK)
        return out

    @_swiglu_op.register_fake
    def _(h):
        return h.new_empty(*h.shape[:-1], h.size(-1) // 2)

    @torch.library.custom_op("paratron::swiglu_backward", mutates_args=())
    def _swiglu_backward_op(h: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
        grid, n_cols = _grid(h)
        dh = torch.empty_like(h)
        dout = dout.contiguous()
        if dh.numel():
            with _on(h):
                _swiglu_bwd[grid](h, dout, dh, n_cols, BLOCK=BLOCK)
        return dh

    @_swiglu_backward_op.register_fake
    def _(h, dout):
        return torch.empty_like(h)

    def _setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def _backward(ctx, dout):
        (h,) = ctx.saved_tensors
        return torch.ops.paratron.swiglu_backward(h, dout)

    _swiglu_op.register_autograd(_backward, setup_context=_setup)
