"""FP8 formats and casts: the e4m3 / e5m2 types, amax, Transformer Engine's scale formula, quantise and
dequantise (torch expressions), and the Triton kernels that write an MLP activation (or its gradient, or a plain
tensor: ``paratron::cast_fp8``) straight into FP8, row-major and transposed, with its amax. The torch
expressions here (``act_fp8_reference``, ``grad_fp8_reference``) are the kernels' references; the kernels run
on CUDA only. Triton's CPU interpreter rounds some float32 -> float8 values differently from the GPU (and from
torch), so the FP8 values are checked on the GPU (tests/gpu/test_cuda_paths.py) against the references, the amax
and scale in the interpreter too (tests/unit/test_fp8_cast_op.py).

Launches: with its own amax (tensorwise), a cast is the amax pass, whose programs take the maximum by an atomic max
into one slot, and the cast pass, whose programs compute the scale from that slot themselves; with a known scale
(the delayed recipe, primed) the cast pass alone. No reduction of partial maxima and no scale arithmetic run
between them as kernels of their own.

Scale: a tensor ``x`` is stored as ``q = saturate(x * scale)`` with ``scale = fmax / (amax * 2**margin)``
(``fmax`` = 448 for e4m3, 57344 for e5m2; scale 1 where amax is 0, inf or NaN, or the quotient overflows).
The recipes that choose the amax are in paratron/fp8/recipe.py; the fused MLP that calls these kernels in
paratron/fp8/mlp.py.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (no host sync)."""
    return x.detach().abs().amax().float()


def compute_scale(a: torch.Tensor, fmax: float, margin: int = 0) -> torch.Tensor:
    """fmax / (a * 2**margin) in fp32; 1 where a is 0 / inf / NaN or the quotient is not finite."""
    a = a.float()
    scale = fmax / (a * (2.0 ** margin))
    ok = torch.isfinite(a) & (a > 0) & torch.isfinite(scale)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(x * scale) saturated to +-fmax of ``dtype`` and cast to it (a plain cast of an out-of-range
    value would give NaN in e4m3fn)."""
    fmax = FMAX[dtype]
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() / scale).to(dtype)

SWIGLU, GELU, GELU_TANH = 0, 1, 2  # the activations of the fused path (``act``)


IDENTITY = 3  # no activation: the kernels as a plain cast + transpose (``cast_fp8``)


# tokens x columns per program and warps, chosen per shape by Triton's autotuner on the first call
# (the best at every measured shape is among these; 128 x 128 and larger tiles spill registers in the GeLU
# kernels and run many times slower: benchmarks/results/fp8_cast_sweep_20261125_224721.md, from a probe kept in
# the git history, benchmarks/README.md)
TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 8), (32, 256, 4), (64, 256, 8))


FAST_RCP = True  # GeLU's reciprocal by the approximate instruction: a faster GeLU forward (the sweep's record above)


MIN_BM = min(t[0] for t in TILES)  # rows of the smallest tile: the bias gradient's partial sums take one row each


def _act_input(h: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return h.float() if bias is None else h.float() + bias.float()


def activation(h: torch.Tensor, act: int) -> torch.Tensor:
    """The activation of fc1's output ``h`` (with its bias), in h's dtype."""
    if act == SWIGLU:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if act == GELU_TANH else "none")


def activation_grad(z: torch.Tensor, d: torch.Tensor, act: int) -> torch.Tensor:
    """d act(z) / dz for the output gradient ``d`` (the formulas of the kernels; tests check them
    against autograd)."""
    if act == SWIGLU:
        gate, up = z.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        return torch.cat([d * up * sig * (1.0 + gate * (1.0 - sig)), d * gate * sig], dim=-1)
    if act == GELU:  # Phi(z) + z phi(z)
        return d * (0.5 * (1.0 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327)
    s = torch.sigmoid(1.5957691216057308 * z * (1.0 + 0.044715 * z * z))  # tanh GeLU = z * s
    return d * (s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z))


def _to_fp8(t: torch.Tensor, preset: torch.Tensor, dtype: torch.dtype, margin: int):
    """(row-major FP8, its transpose, the scale used, the amax of t): the scale is ``preset`` where it
    is positive, else t's own (tensorwise)."""
    current = t.abs().amax()
    scale = torch.where(preset > 0, preset, compute_scale(current, FMAX[dtype], margin))
    q = (t * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
    return q, q.t().contiguous(), scale, current


def act_fp8_reference(h: torch.Tensor, bias: Optional[torch.Tensor], preset: torch.Tensor, act: int, margin: int):
    """The activation of h (+ bias) in e4m3: (row-major [m, F], transposed [F, m], scale, amax)."""
    return _to_fp8(activation(_act_input(h, bias), act), preset, E4M3, margin)


def grad_fp8_reference(h: torch.Tensor, bias: Optional[torch.Tensor], dout: torch.Tensor, preset: torch.Tensor,
                       act: int, e5m2: bool, margin: int):
    """The activation's input gradient for ``dout`` in e5m2 / e4m3 (in fp32): (row-major, transposed,
    scale, amax, the bias gradient in fp32 (empty without a bias))."""
    dh = activation_grad(_act_input(h, bias), dout.float(), act)
    db = dh.sum(0) if bias is not None else h.new_zeros(0, dtype=torch.float32)
    return (*_to_fp8(dh, preset, torch.float8_e5m2 if e5m2 else E4M3, margin), db)


if triton is not None:
    _autotuned = triton.autotune([triton.Config({"BM": bm, "BF": bf}, num_warps=w) for bm, bf, w in TILES],
                                 key=["M", "F", "ACT", "HAS_BIAS"])

    @triton.jit
    def _tile(h_ptr, b_ptr, M, F, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
        """This program's tile of fc1's output (+ bias) in fp32: the gate half (the whole output when
        not gated) and, gated, the matching tile of the up half."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rf = tl.program_id(1) * BF + tl.arange(0, BF)
        mask = (rm[:, None] < M) & (rf[None, :] < F)
        base = h_ptr + rm[:, None].to(tl.int64) * (2 * F if GATED else F) + rf[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            gate += tl.load(b_ptr + rf, mask=rf < F, other=0.0).to(tl.float32)[None, :]
        up = gate
        if GATED:
            up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                up += tl.load(b_ptr + F + rf, mask=rf < F, other=0.0).to(tl.float32)[None, :]
        return rm, rf, mask, gate, up

    @triton.jit
    def _reciprocal(x, FAST: tl.constexpr):
        """1 / x: the hardware's approximate reciprocal (one instruction, ~1 ulp) or a full division."""
        if FAST:
            return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return 1.0 / x

    @triton.jit
    def _normal_cdf_pdf(x, RCP: tl.constexpr):
        """Phi(x) and phi(x) of the standard normal: erf(x / sqrt 2) by Abramowitz & Stegun 7.1.26 (absolute
        error < 1.5e-7, far below bf16's and FP8's steps) sharing its exp(-x^2 / 2) with phi; a few
        multiply-adds instead of libdevice's erf, which made the GeLU kernels compute-bound."""
        z = tl.abs(x) * 0.7071067811865476
        t = _reciprocal(1.0 + 0.3275911 * z, RCP)
        e = tl.exp(-z * z)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erf = 1.0 - poly * e
        return 0.5 + 0.5 * tl.where(x < 0, -erf, erf), e * 0.3989422804014327

    @triton.jit
    def _act(gate, up, ACT: tl.constexpr, RCP: tl.constexpr):
        if ACT == 0:  # SwiGLU
            a = gate * tl.sigmoid(gate) * up
        elif ACT == 1:  # GeLU: x * Phi(x)
            cdf, _ = _normal_cdf_pdf(gate, RCP)
            a = gate * cdf
        elif ACT == 2:  # tanh GeLU: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
            a = gate * tl.sigmoid(1.5957691216057308 * gate * (1.0 + 0.044715 * gate * gate))
        else:  # identity
            a = gate
        return a

    @triton.jit
    def _act_grads(gate, up, d, ACT: tl.constexpr, RCP: tl.constexpr):
        """d/dgate and d/dup (gated; otherwise the second is the first again) for the output gradient d."""
        if ACT == 0:
            sig = tl.sigmoid(gate)
            dg = d * up * sig * (1.0 + gate * (1.0 - sig))
            du = d * gate * sig
        elif ACT == 1:  # Phi(x) + x phi(x)
            cdf, pdf = _normal_cdf_pdf(gate, RCP)
            dg = d * (cdf + gate * pdf)
            du = dg
        else:  # s + x s (1 - s) 2u'
            s = tl.sigmoid(1.5957691216057308 * gate * (1.0 + 0.044715 * gate * gate))
            dg = d * (s + gate * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * gate * gate))
            du = dg
        return dg, du

    @triton.jit
    def _tile_max(amax_ptr, a, mask):
        """The maximum of |a| over this program's tile (inside the mask) into the tensor's amax: an atomic max of
        the float's bits (an int32 slot, zero before the launch), which order as the floats do for the
        non-negative, non-NaN values a tile's maximum takes (``tl.max`` leaves NaN out)."""
        top = tl.max(tl.max(tl.where(mask, tl.abs(a), 0.0), 1), 0)
        tl.atomic_max(amax_ptr, top.to(tl.int32, bitcast=True))

    @triton.jit
    def _scale(preset_ptr, amax_ptr, scale_ptr, FMAX: tl.constexpr, MULT: tl.constexpr):
        """The cast's scale, as :func:`compute_scale` and the preset choice give it in torch: the preset where it is
        positive, else FMAX / (amax * 2**margin) (``MULT``), computed as torch computes a scalar divided by a
        tensor (the reciprocal, rounded to nearest, times FMAX), 1 where amax is 0 or the quotient overflows (the
        amax slot holds no inf or NaN bits past 0x7f800000: a finite check is a compare of bits). Program (0, 0)
        stores it: the op's scale output, written by the kernel that uses it."""
        a_bits = tl.load(amax_ptr)
        a = a_bits.to(tl.float32, bitcast=True)
        s = tl.math.div_rn(1.0, a * MULT) * FMAX
        ok = (a_bits > 0) & (a_bits < 0x7F800000) & (s.to(tl.int32, bitcast=True) < 0x7F800000)
        preset = tl.load(preset_ptr)
        s = tl.where(preset > 0, preset, tl.where(ok, s, 1.0))
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, s)
        return s

    @triton.jit
    def _store_fp8(row_ptr, v, mask, FMAX: tl.constexpr):
        """v (fp32, scaled) saturated, cast to the output's FP8 type and stored row-major at ``row_ptr``."""
        tl.store(row_ptr, tl.clamp(v, -FMAX, FMAX).to(row_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_transposed(row_ptr, col_ptr, mask):
        """The tile just stored row-major at ``row_ptr`` read back and stored transposed at ``col_ptr``
        (call after ``tl.debug_barrier()``: bar.sync makes the block's stores visible to all its threads).
        Storing the FP8 values computed in registers transposed is what Triton 3.6 miscompiles in kernels
        that load two tensors (SwiGLU's halves; an activation and its gradient): part of the transposed
        bytes wrong (benchmarks/results/fp8_transposed_copy_bug_20261125.md; the sweep and the reproducer are
        probes kept in the git history, benchmarks/README.md); transposing loaded bytes is exact at every
        tile. Cost on an H100: the cast with this read-back takes less time than the row-major cast followed
        by a separate one-byte transpose kernel, for GeLU's forward and SwiGLU's backward
        (benchmarks/results/fp8_cast_sweep_20261126_011121.md)."""
        tl.store(col_ptr, tl.trans(tl.load(row_ptr, mask=mask)), mask=tl.trans(mask))

    @_autotuned
    @triton.jit
    def _act_amax(h_ptr, b_ptr, preset_ptr, amax_ptr, M, F, ACT: tl.constexpr, GATED: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RCP: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
        if tl.load(preset_ptr) > 0:  # the scale is given (delayed recipe): no amax pass
            return
        rm, rf, mask, gate, up = _tile(h_ptr, b_ptr, M, F, GATED, HAS_BIAS, BM, BF)
        _tile_max(amax_ptr, _act(gate, up, ACT, RCP), mask)

    @_autotuned
    @triton.jit
    def _act_cast(h_ptr, b_ptr, preset_ptr, amax_ptr, scale_ptr, q_ptr, qt_ptr, M, F, FMAX: tl.constexpr,
                  MULT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RCP: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
        """``amax_ptr``: the slot of what this pass casts (the delayed recipe's record), then the amax pass's."""
        rm, rf, mask, gate, up = _tile(h_ptr, b_ptr, M, F, GATED, HAS_BIAS, BM, BF)
        a = _act(gate, up, ACT, RCP)
        _tile_max(amax_ptr, a, mask)
        row = q_ptr + rm[:, None].to(tl.int64) * F + rf[None, :]
        _store_fp8(row, a * _scale(preset_ptr, amax_ptr + 1, scale_ptr, FMAX, MULT), mask, FMAX)
        tl.debug_barrier()
        _store_transposed(row, qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :], mask)

    @_autotuned
    @triton.jit
    def _grad_amax(h_ptr, b_ptr, d_ptr, preset_ptr, amax_ptr, M, F, ACT: tl.constexpr, GATED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RCP: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
        if tl.load(preset_ptr) > 0:
            return
        rm, rf, mask, gate, up = _tile(h_ptr, b_ptr, M, F, GATED, HAS_BIAS, BM, BF)
        d = tl.load(d_ptr + rm[:, None].to(tl.int64) * F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        dg, du = _act_grads(gate, up, d, ACT, RCP)
        top = tl.abs(dg)
        if GATED:
            top = tl.maximum(top, tl.abs(du))
        _tile_max(amax_ptr, top, mask)

    @_autotuned
    @triton.jit
    def _grad_cast(h_ptr, b_ptr, d_ptr, preset_ptr, amax_ptr, scale_ptr, q_ptr, qt_ptr, db_ptr, M, F,
                   FMAX: tl.constexpr, MULT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RCP: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
        rm, rf, mask, gate, up = _tile(h_ptr, b_ptr, M, F, GATED, HAS_BIAS, BM, BF)
        d = tl.load(d_ptr + rm[:, None].to(tl.int64) * F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        dg, du = _act_grads(gate, up, d, ACT, RCP)
        top = tl.abs(dg)
        if GATED:
            top = tl.maximum(top, tl.abs(du))
        _tile_max(amax_ptr, top, mask)
        s = _scale(preset_ptr, amax_ptr + 1, scale_ptr, FMAX, MULT)
        width = 2 * F if GATED else F
        row = q_ptr + rm[:, None].to(tl.int64) * width + rf[None, :]
        _store_fp8(row, dg * s, mask, FMAX)
        if GATED:
            _store_fp8(row + F, du * s, mask, FMAX)
        tl.debug_barrier()
        col = qt_ptr + rf[:, None].to(tl.int64) * M + rm[None, :]
        _store_transposed(row, col, mask)
        if GATED:
            _store_transposed(row + F, col + F.to(tl.int64) * M, mask)
        if HAS_BIAS:  # column sums of this tile's rows (masked rows have d = 0), one row of partials per row tile
            db = db_ptr + tl.program_id(0).to(tl.int64) * width + rf
            tl.store(db, tl.sum(dg, 0), mask=rf < F)
            if GATED:
                tl.store(db + F, tl.sum(du, 0), mask=rf < F)


def _on_gpu(h: torch.Tensor) -> bool:
    return triton is not None and h.is_cuda


def _grid(m: int, f: int):
    """The launch grid for the tile config the autotuner tries or chose."""
    return lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(f, meta["BF"]))


def _slots(device) -> torch.Tensor:
    """The amax slots of one cast: the cast pass's (first: the op's amax output is the slot itself, a view at the
    buffer's start), then the amax pass's; int32 bits of non-negative floats, zero: each program's atomic max lands
    there (the autotuner's trial launches of a kernel only repeat its maxima)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def _launching(t: torch.Tensor):
    """The context the kernels launch in: ``t``'s CUDA device (nothing to enter for the CPU interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _shape(h: torch.Tensor, act: int) -> tuple[int, int, dict]:
    """Rows, activation width and the kernels' compile-time switches."""
    gated = act == SWIGLU
    return h.size(0), h.size(1) // 2 if gated else h.size(1), dict(ACT=act, GATED=gated, RCP=FAST_RCP)


def _outputs(h: torch.Tensor, cols: int, dtype: torch.dtype):
    """The cast's FP8 tensors, row-major [rows, cols] and transposed, and its fp32 scale, unwritten."""
    m = h.size(0)
    return h.new_empty(m, cols, dtype=dtype), h.new_empty(cols, m, dtype=dtype), h.new_empty((), dtype=torch.float32)


def _fake_outputs(h: torch.Tensor, cols: int, dtype: torch.dtype):
    q, qt, scale = _outputs(h, cols, dtype)
    return q, qt, scale, scale.clone()


def _forward_cast(h: torch.Tensor, bias: Optional[torch.Tensor], preset: torch.Tensor, act: int, dtype: torch.dtype,
                  margin: int, given: bool):
    """The two forward kernels (amax pass, skipped for a preset scale; cast pass, which computes the scale and
    writes it): (q, qt, scale, amax of what was cast). ``given``: the caller knows the preset is positive (a primed
    delayed scaler), so the amax pass is not even launched."""
    m, f, switches = _shape(h, act)
    grid = _grid(m, f)
    slots = _slots(h.device)
    q, qt, scale = _outputs(h, f, dtype)
    b = h if bias is None else bias
    with _launching(h):
        if not given:
            _act_amax[grid](h, b, preset, slots[1:], m, f, HAS_BIAS=bias is not None, **switches)
        _act_cast[grid](h, b, preset, slots, scale, q, qt, m, f, FMAX=FMAX[dtype], MULT=2.0 ** margin,
                        HAS_BIAS=bias is not None, **switches)
    return q, qt, scale, slots.view(torch.float32)[0]


def _backward_cast(h: torch.Tensor, bias: Optional[torch.Tensor], dout: torch.Tensor, preset: torch.Tensor, act: int,
                   dtype: torch.dtype, margin: int, given: bool):
    """The two backward kernels, as :func:`_forward_cast`: (q, qt, scale, amax, the bias gradient (empty without
    a bias))."""
    m, f, switches = _shape(h, act)
    width = h.size(1)
    grid = _grid(m, f)
    dout = dout.contiguous()
    slots = _slots(h.device)
    q, qt, scale = _outputs(h, width, dtype)
    has_bias = bias is not None
    db = torch.zeros(triton.cdiv(m, MIN_BM) if has_bias else 0, width, dtype=torch.float32, device=h.device)
    b = h if bias is None else bias
    with _launching(h):
        if not given:
            _grad_amax[grid](h, b, dout, preset, slots[1:], m, f, HAS_BIAS=has_bias, **switches)
        _grad_cast[grid](h, b, dout, preset, slots, scale, q, qt, db, m, f, FMAX=FMAX[dtype], MULT=2.0 ** margin,
                         HAS_BIAS=has_bias, **switches)
    current = slots.view(torch.float32)[0]
    if not has_bias:
        return q, qt, scale, current, db.new_zeros(0)
    # the rows of partial sums the last launch wrote (the autotuner's trials of smaller tiles may have left more)
    return q, qt, scale, current, db[:triton.cdiv(m, _grad_cast.best_config.kwargs["BM"])].sum(0)


@torch.library.custom_op("paratron::mlp_act_fp8", mutates_args=())
def mlp_act_fp8(h: torch.Tensor, bias: Optional[torch.Tensor], preset: torch.Tensor, act: int,
                margin: int, given: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation of the contiguous fc1 output ``h`` (+ ``bias``) in e4m3, scaled by ``preset``
    where it is positive (the delayed recipe: one pass) or by its own amax (two passes):
    (q, q transposed, scale, amax). ``given``: the preset is known to be positive (no amax pass launched)."""
    if not _on_gpu(h):
        return act_fp8_reference(h, bias, preset, act, margin)
    return _forward_cast(h, bias, preset, act, E4M3, margin, given)


@torch.library.custom_op("paratron::cast_fp8", mutates_args=())
def cast_fp8(x: torch.Tensor, preset: torch.Tensor, e5m2: bool,
             margin: int, given: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contiguous 2-D ``x`` in e5m2 / e4m3, row-major (one pass over x; two for its own amax) and
    transposed (from the FP8 copy), scaled as :func:`mlp_act_fp8`: (q, q transposed, scale, amax). Used
    for the output gradients of the FP8 linears, whose transposed copy is the weight gradient's operand."""
    dtype = torch.float8_e5m2 if e5m2 else E4M3
    if not _on_gpu(x):
        return _to_fp8(x.float(), preset, dtype, margin)
    return _forward_cast(x, None, preset, IDENTITY, dtype, margin, given)


@cast_fp8.register_fake
def _(x, preset, e5m2, margin, given=False):
    return _fake_outputs(x, x.size(1), torch.float8_e5m2 if e5m2 else E4M3)


@torch.library.custom_op("paratron::mlp_act_fp8_backward", mutates_args=())
def mlp_act_fp8_backward(h: torch.Tensor, bias: Optional[torch.Tensor], dout: torch.Tensor, preset: torch.Tensor,
                         act: int, e5m2: bool, margin: int, given: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation's input gradient for ``dout`` [m, F] in FP8, scaled as :func:`mlp_act_fp8`;
    last, the bias gradient (fp32; empty without a bias)."""
    if not _on_gpu(h):
        return grad_fp8_reference(h, bias, dout, preset, act, e5m2, margin)
    return _backward_cast(h, bias, dout, preset, act, torch.float8_e5m2 if e5m2 else E4M3, margin, given)


@mlp_act_fp8.register_fake
def _(h, bias, preset, act, margin, given=False):
    return _fake_outputs(h, _shape(h, act)[1], E4M3)


@mlp_act_fp8_backward.register_fake
def _(h, bias, dout, preset, act, e5m2, margin, given=False):
    db = h.new_empty(h.size(1) if bias is not None else 0, dtype=torch.float32)
    return (*_fake_outputs(h, h.size(1), torch.float8_e5m2 if e5m2 else E4M3), db)
