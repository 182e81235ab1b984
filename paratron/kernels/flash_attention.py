"""FlashAttention-4's Hopper kernels for causal self-attention in training.

torch's SDPA picks cuDNN's fused attention on an H100; at llama-1b's shape (head dim 64, grouped keys)
its backward runs helper kernels besides the attention kernels (the dO.O row sums, the fp32 dQ conversion, a
per-group reduction of dK and dV), a visible share of attention's time in the step's profile
(benchmarks/results/profile_kernels_llama-1b_mb16x2_9e7a219_20261122_1049.tsv). flash-attn-4 (Tri Dao's
FlashAttention in the CuTe DSL, https://github.com/Dao-AILab/flash-attention, the ``flash_attn.cute`` package;
pure Python, compiled at first use) has forward and backward kernels for Hopper that take the grouped keys
as they are and any batch / sequence / head strides. Here they are wrapped as two torch custom ops
(``paratron::flash_attn_fwd`` / ``_bwd``) so that a compiled layer keeps them as single nodes. The forward
op runs cuDNN's fused forward instead where it can and ``cudnn`` is set (``--attention-backend fused``; ``flash``
keeps FlashAttention-4's): it is the faster forward at llama-1b's shape at the power limit
(benchmarks/results/backward_levers_20261126_1420.md), and the backward only needs the forward's output and
log-sum-exp. A layer with the plain rotary embedding takes ``rotary_causal_attention`` instead
(``paratron::flash_attn_rope_fwd`` / ``_bwd``): the same kernels from the QKV GEMM's output, with the rotation
of q and k in two Triton kernels around them (rotary.py says why).

Layout: q [b, s, heads, d], k / v [b, s, groups, d] -- the transposes of paratron's sequence-first
activations, no copies; the output is allocated sequence-first ([s, b, heads, d] storage) so that the
output projection reads it without a copy either.

Chosen when the model is built on a Hopper GPU in bf16 with flash-attn-4 importable (``paratron[hopper]``)
and the layer has no sliding window or attention sinks; a forward pass takes it when it is plain causal
attention over the whole sequence with autograd on and no attention dropout (no mask, no context
parallelism, no KV cache). Everything else, and ``--attention-backend unfused|local``, stays on SDPA; so does
--deterministic-mode: the backward accumulates dQ with atomics, and the kernels' deterministic variant
(``deterministic=True``, 4.0.0b10) still gave gradients that differ bit-wise from run to run on an H100
(a GPU test run of the deterministic variant: benchmarks/results/gpu_tests_flash4_2e5a231.log). The torch
expressions below (``*_ref``) are the same operations; the ops run them on CPUs (the tests).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import rotary
from .experimental import flash_packed
from .hardware import hopper_bf16

try:  # optional: pip install flash-attn-4 (Hopper / Blackwell); used only on CUDA
    from flash_attn.cute.interface import _flash_attn_bwd as _fa_bwd, _flash_attn_fwd as _fa_fwd
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    _fa_fwd = _fa_bwd = None


def available(device, dtype) -> bool:
    """FlashAttention-4 can run for a module built on ``device`` in ``dtype``: the package importable, bf16 on a
    Hopper GPU."""
    return _fa_fwd is not None and hopper_bf16(device, dtype)


def wanted(head_dim: int, device, dtype) -> bool:
    """Whether an attention layer built on ``device`` in ``dtype`` can take FlashAttention-4: ``available`` and
    a head dimension its Hopper kernels have (a multiple of 8 up to 256)."""
    return head_dim % 8 == 0 and head_dim <= 256 and available(device, dtype)


# ---- the operations as torch expressions (the reference; CPUs) ---------------------------------
def _f(t: Tensor) -> Tensor:
    """``t`` in fp32 at least (the kernels' arithmetic; float64 stays float64 for the tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Causal scores [b, heads, s, s] in fp32 from q [b, s, heads, d] and grouped k [b, s, groups, d]."""
    k = k.repeat_interleave(q.size(2) // k.size(2), dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", _f(q), _f(k)) * scale
    n = q.size(1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf"))


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out [b, s, heads, d] in q's dtype, log-sum-exp of each row's scores [b, heads, s], fp32)."""
    s = _scores(q, k, scale)
    lse = torch.logsumexp(s, dim=-1)
    v = _f(v.repeat_interleave(q.size(2) // v.size(2), dim=2))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v)
    return out.to(q.dtype), lse


def attention_bwd_ref(dout, q, k, v, out, lse, scale) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): softmax attention's backward from the forward's ``out`` and ``lse``; the gradients of
    a key / value group are summed over its query heads."""
    rep = q.size(2) // k.size(2)
    p = torch.exp(_scores(q, k, scale) - lse[..., None])
    do = _f(dout)
    kf, vf = (_f(t.repeat_interleave(rep, dim=2)) for t in (k, v))
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - (do * _f(out)).sum(-1).transpose(1, 2)[..., None]) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, _f(q))
    dk, dv = (t.unflatten(2, (k.size(2), rep)).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the custom ops --------------------------------------------------------------------------------
def _seq_first_like(t: Tensor, last: Optional[int] = None) -> Tensor:
    """An empty [b, s, heads, d] tensor like ``t`` (last dimension ``last`` if given) as a view of sequence-first
    storage [s, b, heads, d]: the output, where the output projection reads it without a copy, and the gradients
    of q, k, v, which the rotary embedding's backward reads beside each other into the QKV gradient ([s, b, ...]).
    (``empty_like`` of v, a strided slice of the QKV output, would follow its strides' order instead.)"""
    b, s = t.shape[:2]
    shape = (s, b, *t.shape[2:-1], t.size(-1) if last is None else last)
    return torch.empty(shape, dtype=t.dtype, device=t.device).transpose(0, 1)


_cudnn_op = torch.ops.aten._scaled_dot_product_cudnn_attention


def _cudnn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Optional[tuple[Tensor, Tensor]]:
    """cuDNN's fused causal forward (the kernel SDPA picks on an H100) on the same views, with its log-sum-exp
    for FlashAttention-4's backward; None where it does not apply (no cuDNN, head
    dims over 128) or its output is not sequence-first (it follows q's layout: then FlashAttention-4's forward
    runs; GPU tests: tests/gpu/test_flash_attention_cuda.py, test_rope_flash_cuda.py)."""
    if q.size(-1) > 128 or v.size(-1) != q.size(-1) or not torch.backends.cudnn.is_available():
        return None
    try:
        out, lse = _cudnn_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, True, False,
                             scale=scale)[:2]
    except RuntimeError as e:  # a shape or cuDNN version without this kernel: FlashAttention-4's forward instead
        warnings.warn(f"cuDNN attention forward unavailable here ({str(e).splitlines()[0][:120]}); "
                      "using FlashAttention-4's forward", stacklevel=2)
        return None
    out = out.transpose(1, 2)
    b, _, h, d = out.shape
    if out.stride() != (h * d, b * h * d, d, 1):  # [b, s, heads, d] viewing [s, b, heads, d] storage
        return None
    return out, lse.reshape(q.size(0), q.size(2), q.size(1)).contiguous()


@torch.library.custom_op("paratron::flash_attn_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, cudnn: bool) -> tuple[Tensor, Tensor]:
    if q.is_cuda and cudnn and (found := _cudnn_fwd(q, k, v, scale)) is not None:
        return found
    out = _seq_first_like(q, v.size(-1))
    if not q.is_cuda:
        ref, lse = attention_ref(q, k, v, scale)
        return out.copy_(ref), lse
    _, lse = _fa_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True, out=out)
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, scale, cudnn):
    b, s, h = q.shape[:3]
    return _seq_first_like(q, v.size(-1)), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("paratron::flash_attn_bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (_seq_first_like(t) for t in (q, k, v))
    _bwd_into(dout, q, k, v, out, lse, scale, dq, dk, dv)
    return dq, dk, dv


def _bwd_into(dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
    """FlashAttention-4's backward (CPUs: the reference) into dq, dk, dv ([b, s, heads | groups, d] views)."""
    if not q.is_cuda:
        for d, ref in zip((dq, dk, dv), attention_bwd_ref(dout, q, k, v, out, lse, scale)):
            d.copy_(ref)
    else:
        _fa_bwd(q, k, v, out, dout, lse, scale, True, dq=dq, dk=dk, dv=dv)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, scale):
    return tuple(_seq_first_like(t) for t in (q, k, v))


def _setup(ctx, inputs, output) -> None:
    q, k, v, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale=None, cudnn: bool = True) -> Tensor:
    """Causal attention of sequence-first q [s, b, heads, d], k / v [s, b, groups, d] (grouped heads);
    returns [s, b, heads * d]. ``scale`` None: 1 / sqrt(d). ``cudnn``: cuDNN's fused forward where it runs
    (``--attention-backend fused``), else FlashAttention-4's."""
    s, b, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out, _ = _fwd(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, cudnn)
    return out.transpose(0, 1).reshape(s, b, h * v.size(-1))


# ---- with the rotary embedding of q and k around it (rotary.py) ----------------------------------------
# One op from the QKV GEMM's output to attention's output: its forward rotates q and k in one kernel and runs
# FlashAttention-4 on them and on v, a strided slice of the QKV output; its backward allocates the QKV gradient
# [s, b, groups, q_per_group + 2, d], lets FlashAttention-4 write dv and dk into their slots (its kernels are
# compiled for any strides that are multiples of 16 bytes with the last dimension contiguous, and
# ``_validate_tensor`` checks shape, dtype and device only; with grouped heads a postprocess kernel converts its
# fp32 dK / dV accumulators into them), dq into a buffer of its own (the query heads are not evenly strided
# inside a group's slots), then one kernel rotates dq into the query slots and dk back in place.
@torch.library.custom_op("paratron::flash_attn_rope_fwd", mutates_args=())
def _rope_fwd(qkv5: Tensor, cos: Tensor, sin: Tensor, scale: float, cudnn: bool,
              packed: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q and k rotated [s, b, heads | groups, d] -- kept for the backward --, out [s, b, heads, d], lse).
    ``packed``: the backward may take the experimental packed grouped-key kernel (kernels/experimental)."""
    q, k = rotary.rotate_qk(qkv5, cos, sin)
    out, lse = _fwd(q.transpose(0, 1), k.transpose(0, 1), qkv5[:, :, :, -1].transpose(0, 1), scale, cudnn)
    return q, k, out.transpose(0, 1), lse


@_rope_fwd.register_fake
def _rope_fwd_fake(qkv5, cos, sin, scale, cudnn, packed):
    s, b, groups, slots, d = qkv5.shape
    heads = groups * (slots - 2)
    return (qkv5.new_empty(s, b, heads, d), qkv5.new_empty(s, b, groups, d), qkv5.new_empty(s, b, heads, d),
            qkv5.new_empty((b, heads, s), dtype=torch.float32))


@torch.library.custom_op("paratron::flash_attn_rope_bwd", mutates_args=())
def _rope_bwd(dout: Tensor, qkv5: Tensor, cos: Tensor, sin: Tensor, q: Tensor, k: Tensor, out: Tensor,
              lse: Tensor, scale: float, packed: bool) -> Tensor:
    """The gradient of qkv5 (contiguous) from the output's gradient dout [s, b, heads, d]."""
    dqkv = qkv5.new_empty(qkv5.shape)
    dk, dv = dqkv[:, :, :, -2], dqkv[:, :, :, -1]  # FlashAttention-4 writes them in place
    v = qkv5[:, :, :, -1]
    args = tuple(t.transpose(0, 1) for t in (dout, q, k, v, out))
    if packed and flash_packed.applies(args[1], args[2], args[0]):  # a group's query heads in one CTA
        dq = flash_packed.backward(*args, lse, scale, dk.transpose(0, 1), dv.transpose(0, 1))
        rotary.unrotate_into_(dqkv, dq.permute(2, 0, 1, 3, 4), cos, sin)  # its buffer read in place
        return dqkv
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _bwd_into(*args, lse, scale, *(t.transpose(0, 1) for t in (dq, dk, dv)))
    rotary.unrotate_into_(dqkv, dq, cos, sin)
    return dqkv


@_rope_bwd.register_fake
def _rope_bwd_fake(dout, qkv5, cos, sin, q, k, out, lse, scale, packed):
    return qkv5.new_empty(qkv5.shape)


def _rope_setup(ctx, inputs, output) -> None:
    qkv5, cos, sin, scale, _, packed = inputs
    q, k, out, lse = output
    ctx.save_for_backward(qkv5, cos, sin, q, k, out, lse)
    ctx.scale, ctx.packed = scale, packed
    ctx.mark_non_differentiable(q, k, lse)  # the rotated q and k are outputs only to be kept for the backward
    ctx.set_materialize_grads(False)  # no zero gradients made for them


def _rope_backward(ctx, dq_unused, dk_unused, dout, dlse_unused):
    if dout is None:
        return None, None, None, None, None, None
    qkv5, cos, sin, q, k, out, lse = ctx.saved_tensors
    return _rope_bwd(dout, qkv5, cos, sin, q, k, out, lse, ctx.scale, ctx.packed), None, None, None, None, None


_rope_fwd.register_autograd(_rope_backward, setup_context=_rope_setup)


def rotary_causal_attention(qkv5: Tensor, cos: Tensor, sin: Tensor, scale, q_per_group: int, cudnn: bool = True,
                            packed: bool = True) -> Tensor:
    """Causal attention of the QKV GEMM's output viewed [s, b, groups, q_per_group + 2, d] (per group its query
    heads, its key head, its value head) with the rotary embedding (rotate-half, the whole head) of its queries
    and keys: ``apply_rotary`` then ``causal_attention`` as one op. cos / sin: [s, d] or [s, 1, 1, d] (no cos / sin
    gradient). Returns [s, b, heads * d]. ``scale`` None: 1 / sqrt(d). ``cudnn`` as ``causal_attention``;
    ``packed``: the backward may take the experimental packed grouped-key kernel where it applies."""
    s, b, groups, slots, d = qkv5.shape
    if slots != q_per_group + 2 or cos.numel() != s * d or sin.numel() != s * d:
        raise ValueError(f"rotary_causal_attention: qkv {tuple(qkv5.shape)} with {q_per_group} queries per group, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _, _, out, _ = _rope_fwd(qkv5, cos.reshape(s, d), sin.reshape(s, d), scale, cudnn, packed)
    return out.reshape(s, b, groups * q_per_group * d)
