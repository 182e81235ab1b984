"""The SwiGLU MLP in FP8 as one autograd function: fc1 -> SwiGLU -> fc2, the SwiGLU output and its
gradient written straight into FP8.

Run layer by layer (``fp8.fp8_linear`` for fc1 and fc2 around the SwiGLU kernel), the tensor between
the two matmuls makes extra trips through memory: the SwiGLU writes its output in bf16, fc2 reads it
once for the amax and once more to cast it, and the backward transposes the FP8 copy for the weight
gradient; in the backward the SwiGLU writes the [tokens, 2F] gradient in bf16 (the largest tensor of
the block) and fc1 reads it twice (amax, cast) and writes an FP8 copy plus its transpose. Here each
of the two is computed from the SwiGLU's inputs and written once, in FP8, both row-major (for the next
matmul) and transposed (for the weight gradient). With the tensorwise recipe that takes two passes:
the first only finds the amax (one partial maximum per tile, no atomics), the second recomputes the
SwiGLU (or its gradient) and casts. With the delayed recipe, once primed (``fp8.Scaler``), the scale
is known beforehand and the first pass is skipped: the cast pass also leaves the per-tile maxima the
history records. At llama-1b's shape that moves about 2.4 GB less per layer and micro-batch of
16 x 2048 tokens than the per-layer path (tensorwise), and another ~1 GB less with the delayed recipe.

Numerics are those of the recipe (``fp8.py``); the one difference from the layer-by-layer path is that
the SwiGLU output and gradient are quantised from fp32 instead of from their bf16 rounding. A bias,
``--glu-linear-offset`` or a clamp keep the layer-by-layer path (the caller decides, ``applies``).

The Triton kernels run on CUDA; elsewhere (the CPU tests) the same two ops are torch expressions.
Triton's CPU interpreter rounds float32 -> float8 differently from the GPU (and from torch), so the
kernels are checked on the GPU (tests/gpu/test_cuda_paths.py) against the torch expressions here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import E4M3, FMAX, FP8State, FAST_ACCUM_FORWARD, column_major, compute_scale, forward_mm, input_grad_mm, \
    scaled_mm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# tokens x columns per program and warps, chosen per shape by Triton's autotuner on the first call
TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (32, 256, 4))
MIN_BM, MIN_BF = min(t[0] for t in TILES), min(t[1] for t in TILES)


def applies(fc1, fc2, activation_is_swiglu: bool) -> bool:
    """Whether the fused FP8 MLP can replace fc1 -> SwiGLU -> fc2 (no biases; either recipe)."""
    s1, s2 = fc1.fp8, fc2.fp8
    return (activation_is_swiglu and s1 is not None and s2 is not None and s1.recipe.fuse_mlp
            and fc1.bias is None and fc2.bias is None)


# ---- the two ops, as torch expressions (CPU, and the reference of the kernels) -----------------
def _swiglu_parts(h: torch.Tensor):
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return gate, up, sig


def _to_fp8(t: torch.Tensor, preset: torch.Tensor, dtype: torch.dtype, margin: int):
    """(row-major FP8, its transpose, the scale used, the amax of t): the scale is ``preset`` where it
    is positive, else t's own (tensorwise)."""
    current = t.abs().amax()
    scale = torch.where(preset > 0, preset, compute_scale(current, FMAX[dtype], margin))
    q = (t * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
    return q, q.t().contiguous(), scale, current


def act_fp8_reference(h: torch.Tensor, preset: torch.Tensor, margin: int):
    """silu(gate) * up of h = [gate | up] [m, 2F] in e4m3: (row-major [m, F], transposed [F, m], scale, amax)."""
    gate, up, sig = _swiglu_parts(h)
    return _to_fp8(gate * sig * up, preset, E4M3, margin)


def grad_fp8_reference(h: torch.Tensor, dout: torch.Tensor, preset: torch.Tensor, e5m2: bool, margin: int):
    """The SwiGLU gradient d/d[gate | up] [m, 2F] in e5m2 / e4m3: (row-major, transposed [2F, m], scale, amax)."""
    gate, up, sig = _swiglu_parts(h)
    d = dout.float()
    dh = torch.cat([d * up * sig * (1.0 + gate * (1.0 - sig)), d * gate * sig], dim=-1)
    return _to_fp8(dh, preset, torch.float8_e5m2 if e5m2 else E4M3, margin)


if triton is not None:
    _autotuned = triton.autotune([triton.Config({"BM": bm, "BF": bf}, num_warps=w) for bm, bf, w in TILES],
                                 key=["M", "F"])

    @triton.jit
    def _tile(h_ptr, pid_m, pid_f, M, F, BM: tl.constexpr, BF: tl.constexpr):
        rm = pid_m * BM + tl.arange(0, BM)
        rf = pid_f * BF + tl.arange(0, BF)
        mask = (rm[:, None] < M) & (rf[None, :] < F)
        base = h_ptr + rm[:, None].to(tl.int64) * (2 * F) + rf[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
        return rm, rf, mask, gate, up

    @triton.jit
    def _grads(gate, up, d):
        sig = tl.sigmoid(gate)
        return d * up * sig * (1.0 + gate * (1.0 - sig)), d * gate * sig

    @triton.jit
    def _tile_max(part_ptr, a):
        """One partial maximum of |a| per program (the slot of its tile)."""
        tl.store(part_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(tl.max(tl.abs(a), 1), 0))

    @_autotuned
    @triton.jit
    def _act_amax(h_ptr, preset_ptr, part_ptr, M, F, BM: tl.constexpr, BF: tl.constexpr):
        if tl.load(preset_ptr) > 0:  # the scale is given (delayed recipe): no amax pass
            return
        pid_m, pid_f = tl.program_id(0), tl.program_id(1)
        rm, rf, mask, gate, up = _tile(h_ptr, pid_m, pid_f, M, F, BM, BF)
        a = gate * tl.sigmoid(gate) * up
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_f, tl.max(tl.max(tl.abs(a), 1), 0))

    @_autotuned
    @triton.jit
    def _act_cast(h_ptr, scale_ptr, q_ptr, qt_ptr, part_ptr, M, F, FMAX: tl.constexpr, BM: tl.constexpr,
                  BF: tl.constexpr):
        rm, rf, mask, gate, up = _tile(h_ptr, tl.program_id(0), tl.program_id(1), M, F, BM, BF)
        a = gate * tl.sigmoid(gate) * up
        _tile_max(part_ptr, a)
        q = tl.clamp(a * tl.load(scale_ptr), -FMAX, FMAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None].to(tl.int64) * F + rf[None, :], q, mask=mask)
        tl.store(qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))

    @_autotuned
    @triton.jit
    def _grad_amax(h_ptr, d_ptr, preset_ptr, part_ptr, M, F, BM: tl.constexpr, BF: tl.constexpr):
        if tl.load(preset_ptr) > 0:
            return
        pid_m, pid_f = tl.program_id(0), tl.program_id(1)
        rm, rf, mask, gate, up = _tile(h_ptr, pid_m, pid_f, M, F, BM, BF)
        d = tl.load(d_ptr + rm[:, None].to(tl.int64) * F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        dgate, dup = _grads(gate, up, d)
        top = tl.maximum(tl.max(tl.max(tl.abs(dgate), 1), 0), tl.max(tl.max(tl.abs(dup), 1), 0))
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_f, top)

    @_autotuned
    @triton.jit
    def _grad_cast(h_ptr, d_ptr, scale_ptr, q_ptr, qt_ptr, part_ptr, M, F, FMAX: tl.constexpr, BM: tl.constexpr,
                   BF: tl.constexpr):
        rm, rf, mask, gate, up = _tile(h_ptr, tl.program_id(0), tl.program_id(1), M, F, BM, BF)
        d = tl.load(d_ptr + rm[:, None].to(tl.int64) * F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        dgate, dup = _grads(gate, up, d)
        _tile_max(part_ptr, tl.maximum(tl.abs(dgate), tl.abs(dup)))
        s = tl.load(scale_ptr)
        qg = tl.clamp(dgate * s, -FMAX, FMAX).to(q_ptr.dtype.element_ty)
        qu = tl.clamp(dup * s, -FMAX, FMAX).to(q_ptr.dtype.element_ty)
        row = q_ptr + rm[:, None].to(tl.int64) * (2 * F) + rf[None, :]
        tl.store(row, qg, mask=mask)
        tl.store(row + F, qu, mask=mask)
        col = qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :]
        tl.store(col, tl.trans(qg), mask=tl.trans(mask))
        tl.store(col + F.to(tl.int64) * M, tl.trans(qu), mask=tl.trans(mask))


def _on_gpu(h: torch.Tensor) -> bool:
    return triton is not None and h.is_cuda


def _grid(m: int, f: int):
    """The launch grid for the tile config the autotuner tries or chose."""
    return lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(f, meta["BF"]))


def _partials(m: int, f: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two buffers (amax pass, cast pass) with one slot per tile for the smallest tiles (zeros: slots
    a larger tile leaves unused cannot win)."""
    return torch.zeros(2, triton.cdiv(m, MIN_BM) * triton.cdiv(f, MIN_BF), dtype=torch.float32,
                       device=device).unbind(0)


def _fake_outputs(h: torch.Tensor, cols: int, dtype: torch.dtype):
    m = h.size(0)
    scalar = h.new_empty((), dtype=torch.float32)
    return h.new_empty(m, cols, dtype=dtype), h.new_empty(cols, m, dtype=dtype), scalar, scalar.clone()


@torch.library.custom_op("paratron::swiglu_fp8", mutates_args=())
def swiglu_fp8(h: torch.Tensor, preset: torch.Tensor,
               margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU of the contiguous [m, 2F] ``h`` in e4m3, scaled by ``preset`` where it is positive (the
    delayed recipe: one pass) or by its own amax (two passes): (q, q transposed, scale, amax)."""
    if not _on_gpu(h):
        return act_fp8_reference(h, preset, margin)
    m, f = h.size(0), h.size(1) // 2
    grid = _grid(m, f)
    part, part_cast = _partials(m, f, h.device)
    q = torch.empty(m, f, dtype=E4M3, device=h.device)
    qt = torch.empty(f, m, dtype=E4M3, device=h.device)
    with torch.cuda.device(h.device):
        _act_amax[grid](h, preset, part, m, f)
        scale = torch.where(preset > 0, preset, compute_scale(part.amax(), FMAX[E4M3], margin))
        _act_cast[grid](h, scale, q, qt, part_cast, m, f, FMAX=FMAX[E4M3])
    return q, qt, scale, part_cast.amax()


@swiglu_fp8.register_fake
def _(h, preset, margin):
    return _fake_outputs(h, h.size(1) // 2, E4M3)


@torch.library.custom_op("paratron::swiglu_fp8_backward", mutates_args=())
def swiglu_fp8_backward(h: torch.Tensor, dout: torch.Tensor, preset: torch.Tensor, e5m2: bool,
                        margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SwiGLU gradient for the output gradient ``dout`` [m, F] in FP8, scaled as :func:`swiglu_fp8`."""
    if not _on_gpu(h):
        return grad_fp8_reference(h, dout, preset, e5m2, margin)
    dtype = torch.float8_e5m2 if e5m2 else E4M3
    m, f = h.size(0), h.size(1) // 2
    grid = _grid(m, f)
    dout = dout.contiguous()
    part, part_cast = _partials(m, f, h.device)
    q = torch.empty(m, 2 * f, dtype=dtype, device=h.device)
    qt = torch.empty(2 * f, m, dtype=dtype, device=h.device)
    with torch.cuda.device(h.device):
        _grad_amax[grid](h, dout, preset, part, m, f)
        scale = torch.where(preset > 0, preset, compute_scale(part.amax(), FMAX[dtype], margin))
        _grad_cast[grid](h, dout, scale, q, qt, part_cast, m, f, FMAX=FMAX[dtype])
    return q, qt, scale, part_cast.amax()


@swiglu_fp8_backward.register_fake
def _(h, dout, preset, e5m2, margin):
    return _fake_outputs(h, h.size(1), torch.float8_e5m2 if e5m2 else E4M3)


class _FP8SwiGLUMLP(torch.autograd.Function):
    """y = SwiGLU(x W1^T) W2^T with every matmul in FP8 (the two layers' own scalers for x, the
    weights and fc2's output gradient; the SwiGLU output and gradient scaled here)."""

    @staticmethod
    def forward(ctx, x, w1, w2, s1: FP8State, s2: FP8State):
        h, xq, sx, w1q, sw1 = forward_mm(x.reshape(-1, x.size(-1)), w1, s1, x.dtype)
        s2.mark("input")
        aq, aqt, sa, current = torch.ops.paratron.swiglu_fp8(h, s2.input.preset_scale(h.device), s1.recipe.margin)
        s2.input.record(current)
        w2q, sw2 = s2.quantize("weight", w2)
        y = scaled_mm(aq, w2q.t(), sa, sw2, x.dtype, s2.recipe.emulate, FAST_ACCUM_FORWARD)
        ctx.save_for_backward(xq, w1q, w2q, h, aqt, sx, sw1, sw2, sa)
        ctx.s1, ctx.s2, ctx.x_shape, ctx.w_dtype = s1, s2, x.shape, w1.dtype
        return y.view(*x.shape[:-1], w2.size(0))

    @staticmethod
    def backward(ctx, g):
        xq, w1q, w2q, h, aqt, sx, sw1, sw2, sa = ctx.saved_tensors
        s1, s2 = ctx.s1, ctx.s2
        emulate, margin = s1.recipe.emulate, s1.recipe.margin
        gq, sg = s2.quantize("grad", g.reshape(-1, g.size(-1)))
        dact = input_grad_mm(gq, sg, w2q, sw2, g.dtype, emulate)  # [m, F]
        gw2 = scaled_mm(gq.t().contiguous(), aqt.t(), sg, sa, ctx.w_dtype, emulate)
        s1.mark("grad")
        dhq, dhqt, sdh, current = torch.ops.paratron.swiglu_fp8_backward(h, dact, s1.grad.preset_scale(h.device),
                                                                          s1.grad.dtype != E4M3, margin)
        s1.grad.record(current)
        gx = input_grad_mm(dhq, sdh, w1q, sw1, g.dtype, emulate).view(ctx.x_shape)
        gw1 = scaled_mm(dhqt, column_major(xq), sdh, sx, ctx.w_dtype, emulate)
        return gx, gw1, gw2, None, None


def fp8_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, s1: FP8State, s2: FP8State) -> torch.Tensor:
    """``F.linear(swiglu(F.linear(x, w1)), w2)`` in FP8 (the local matmuls of a TP-split MLP)."""
    return _FP8SwiGLUMLP.apply(x, w1, w2, s1, s2)


def reference_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)
