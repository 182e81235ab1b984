"""The rotary embedding (rotate-half) of queries and keys around FlashAttention-4 as two Triton kernels.

Attention's QKV GEMM writes [s, b, groups * (q_per_group + 2) * d], viewed [s, b, groups, q_per_group + 2, d]
(Megatron's grouped layout: per group its query heads, its key head, its value head). FlashAttention-4 wants
q [s, b, heads, d] and k [s, b, groups, d] with the rotation applied; it takes v as the strided slice of that
view. Under torch.compile Inductor generated the rotation's kernels itself: on an H100 at llama-1b's shape
(32 query heads, 8 groups, head dim 64, seq 2048, micro-batch 16, bf16) one kernel per layer and micro-batch
forward, and backward one kernel, which reads FlashAttention-4's separate dq, dk and dv and writes the
[s, b, groups, 6, d] QKV gradient well below the memory bandwidth, plus a smaller one: together a visible
share of the step (benchmarks/results/profile_kernels_llama-1b_mb16x2_7056be8.tsv).

Here each direction is one memory-bound pass:
  * ``rotate_qk`` (forward): reads the query and key slots of the QKV view once and writes q and k rotated,
    contiguous. At llama-1b's shape 40 heads of 128 bytes read and 40 written per token.
  * ``unrotate_into_`` (backward): FlashAttention-4's backward writes dv and dk straight into their slots of
    the QKV gradient (flash_attention.py) and dq into a buffer of its own (a group's query heads are not evenly
    strided inside the QKV layout); this kernel writes the rotation's backward of dq into the query slots and
    rotates dk back in place: 32 + 8 heads read and written per token. Inductor's two kernels also
    copied dv into the QKV gradient and wrote the rotated dk to a buffer that the second one read again.
The rotation's backward is its transpose: out = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]
gives dx = dout * cos + rotate_half^T(dout * sin), rotate_half^T(y) = [y2, -y1].

Rounding: as the model's ``apply_rotary`` in eager mode, cos and sin in x's dtype, each product rounded to that
dtype, then the sum (bf16: bit-identical to ``apply_rotary`` and to its autograd backward). Inductor's kernels
of the same expression round once, at the end, so the compiled unfused path can differ from these in the last
bit of bf16.

The torch expressions (``*_ref``) are the same operations; they run on CPUs, and whenever the kernels cannot
(no Triton, another dtype, a last dimension that is not contiguous). Under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, the tests) the kernels run on CPU tensors too.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_T = 64  # tokens (rows of [s * b]) per program; each program does one group's heads of them
NUM_WARPS = 4  # (other values were timed by a probe kept in the git history, benchmarks/README.md)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding, rotate-half form, of the first ``cos.size(-1)`` dimensions of ``x`` (the rest
    passes): the reference of the kernels here, and what the model runs outside them."""
    d = cos.size(-1)
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return out if rest.numel() == 0 else torch.cat([out, rest], dim=-1)


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels run on these tensors: Triton importable, on CUDA (or under Triton's interpreter),
    the first one in a dtype the kernels take, every last dimension contiguous."""
    return (triton is not None and tensors[0].dtype in _DTYPES
            and all((t.is_cuda or _INTERPRET) and t.stride(-1) == 1 for t in tensors))


# ---- the operations as torch expressions (the reference; CPUs) ---------------------------------
def _split(qkv5: Tensor) -> tuple[int, int, int, int, int]:
    s, b, groups, slots, d = qkv5.shape
    return s, b, groups, slots - 2, d


def rotate_qk_ref(qkv5: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q [s, b, heads, d], k [s, b, groups, d]) rotated, contiguous, from qkv5 [s, b, groups, qpg + 2, d] and
    cos / sin [s, d]: the model's ``apply_rotary`` itself."""
    s, b, groups, qpg, d = _split(qkv5)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    q = qkv5[:, :, :, :qpg].reshape(s, b, groups * qpg, d)
    return apply_rotary(q, cos, sin).contiguous(), apply_rotary(qkv5[:, :, :, qpg], cos, sin).contiguous()


def unrotate_ref(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotation's backward: g * cos + rotate_half^T(g * sin), in g's dtype as autograd computes it for
    ``apply_rotary`` (cos / sin broadcasting over g)."""
    gs = g * sin.to(g.dtype)
    g1s, g2s = gs.chunk(2, dim=-1)
    return g * cos.to(g.dtype) + torch.cat([g2s, -g1s], dim=-1)


def unrotate_into_ref_(dqkv: Tensor, dq: Tensor, cos: Tensor, sin: Tensor) -> None:
    """``unrotate_into_`` in torch: dqkv's query slots from dq [s, b, heads, d] (or [s, b, groups, q_per_group,
    d]), its key slot in place."""
    s, b, groups, qpg, d = _split(dqkv)
    cos5, sin5 = cos[:, None, None, None, :], sin[:, None, None, None, :]
    dqkv[:, :, :, :qpg] = unrotate_ref(dq.reshape(s, b, groups, qpg, d), cos5, sin5)
    dqkv[:, :, :, qpg] = unrotate_ref(dqkv[:, :, :, qpg], cos5[:, :, :, 0], sin5[:, :, :, 0])


# ---- the kernels ------------------------------------------------------------------------------------
if triton is not None:
    _BY_BITS = tl.constexpr(_INTERPRET)

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """fp32 ``x`` rounded to ``dtype`` (to nearest, ties to even), kept in fp32. bf16 on the GPU by the
        two-lane conversion instruction that rounds so (``cvt.rn.bf16x2.f32``); Triton's own cast there and back
        was not bit-exact against torch (tests/gpu/test_rope_flash_cuda.py failed with it), and rounding by the
        bits is slower than the conversion instruction, the two-lane one at least as fast as the one-lane one (the
        kernels alone: benchmarks/results/rope_flash_20261126_160236.md). Under Triton's CPU interpreter, which
        truncates such casts and runs no PTX, by the bits (several integer operations per value)."""
        if dtype == tl.bfloat16 and not _BY_BITS:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                             is_pure=True, pack=2).to(tl.float32)
        elif dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _as(x, dtype: tl.constexpr):
        """A loaded tile in fp32, rounded to ``dtype``'s values (cos / sin as ``cos.to(x.dtype)``)."""
        return _round(x.to(tl.float32), dtype)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, pos, sc_s, ss_s, cols, HALF: tl.constexpr, mask, dtype: tl.constexpr):
        """cos and sin of the tiles' rows, each half [BLOCK_T, BLOCK_H], rounded to ``dtype``, in fp32."""
        c = cos_ptr + (pos * sc_s)[:, None] + cols[None, :]
        s = sin_ptr + (pos * ss_s)[:, None] + cols[None, :]
        return (_as(tl.load(c, mask=mask), dtype), _as(tl.load(c + HALF, mask=mask), dtype),
                _as(tl.load(s, mask=mask), dtype), _as(tl.load(s + HALF, mask=mask), dtype))

    @triton.jit
    def _mul_add(a, ca, b, sb, NEG: tl.constexpr, dtype: tl.constexpr):
        """a * ca + b * sb (NEG: a * ca - b * sb) of fp32 tiles holding ``dtype`` values, as torch computes it
        in ``dtype``: each product (exact in fp32 for bf16 operands) rounded to it, then the sum; returned in
        ``dtype``."""
        q = _round(b * sb, dtype)
        q = -q if NEG else q
        return _round(_round(a * ca, dtype) + q, dtype).to(dtype)

    @triton.jit
    def _rotate_fwd(x_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, n_rows, batch, sx_s, sx_b, sx_g, sx_j, sc_s, ss_s,
                    QPG: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
        """One group's query heads and key head of BLOCK_T tokens: out = [x1 c1 - x2 s1, x2 c2 + x1 s2]
        into q [s * b, groups * QPG, 2 * HALF] and k [s * b, groups, 2 * HALF] (contiguous)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        g = tl.program_id(1).to(tl.int64)
        groups = tl.num_programs(1)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
        pos = rows // batch
        dtype = q_ptr.dtype.element_ty
        c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, pos, sc_s, ss_s, cols, HALF, mask, dtype)
        src = x_ptr + (pos * sx_s + (rows % batch) * sx_b + g * sx_g)[:, None] + cols[None, :]
        for j in tl.static_range(QPG + 1):
            x1 = tl.load(src + j * sx_j, mask=mask).to(tl.float32)  # (dtype's values already)
            x2 = tl.load(src + j * sx_j + HALF, mask=mask).to(tl.float32)
            if j < QPG:
                dst = q_ptr + ((rows * groups + g) * QPG + j)[:, None] * (2 * HALF) + cols[None, :]
            else:
                dst = k_ptr + (rows * groups + g)[:, None] * (2 * HALF) + cols[None, :]
            tl.store(dst, _mul_add(x1, c1, x2, s1, True, dtype), mask=mask)
            tl.store(dst + HALF, _mul_add(x2, c2, x1, s2, False, dtype), mask=mask)

    @triton.jit
    def _rotate_bwd(dq_ptr, cos_ptr, sin_ptr, dx_ptr, n_rows, batch, sq_s, sq_b, sq_g, sq_j,
                    sx_s, sx_b, sx_g, sx_j, sc_s, ss_s,
                    QPG: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
        """The rotation's backward d = [g1 c1 + g2 s2, g2 c2 - g1 s1] for one group of BLOCK_T tokens: of dq's
        heads into dx's query slots, and of dx's key slot in place (each element read, then written, by the
        same program)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        g = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
        pos, b = rows // batch, rows % batch
        dtype = dx_ptr.dtype.element_ty
        c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, pos, sc_s, ss_s, cols, HALF, mask, dtype)
        dst = dx_ptr + (pos * sx_s + b * sx_b + g * sx_g)[:, None] + cols[None, :]
        for j in tl.static_range(QPG + 1):
            if j < QPG:
                src = dq_ptr + (pos * sq_s + b * sq_b + g * sq_g + j * sq_j)[:, None] + cols[None, :]
            else:
                src = dst + QPG * sx_j
            g1 = tl.load(src, mask=mask).to(tl.float32)  # (dtype's values already)
            g2 = tl.load(src + HALF, mask=mask).to(tl.float32)
            tl.store(dst + j * sx_j, _mul_add(g1, c1, g2, s2, False, dtype), mask=mask)
            tl.store(dst + j * sx_j + HALF, _mul_add(g2, c2, g1, s1, True, dtype), mask=mask)


def _on(t: Tensor):
    """Launch on the tensor's GPU (CPU: Triton's interpreter, in tests)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _launch_args(x5: Tensor, cos: Tensor, sin: Tensor) -> tuple:
    s, b, groups, qpg, d = _split(x5)
    grid = (triton.cdiv(s * b, BLOCK_T), groups)
    meta = dict(QPG=qpg, HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2), BLOCK_T=BLOCK_T, num_warps=NUM_WARPS)
    return grid, (s * b, b), (*x5.stride()[:4], cos.stride(0), sin.stride(0)), meta


def rotate_qk(qkv5: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q [s, b, heads, d], k [s, b, groups, d]), rotated and contiguous, from the QKV view qkv5
    [s, b, groups, q_per_group + 2, d] and cos / sin [s, d]; one kernel where ``usable``."""
    if not usable(qkv5, cos, sin) or qkv5.size(-1) % 2:
        return rotate_qk_ref(qkv5, cos, sin)
    s, b, groups, qpg, d = _split(qkv5)
    q = qkv5.new_empty(s, b, groups * qpg, d)
    k = qkv5.new_empty(s, b, groups, d)
    if q.numel():
        grid, sizes, strides, meta = _launch_args(qkv5, cos, sin)
        with _on(qkv5):
            _rotate_fwd[grid](qkv5, cos, sin, q, k, *sizes, *strides, **meta)
    return q, k


def unrotate_into_(dqkv: Tensor, dq: Tensor, cos: Tensor, sin: Tensor) -> None:
    """The rotation's backward into the QKV gradient dqkv [s, b, groups, q_per_group + 2, d]: its query slots
    from dq [s, b, heads, d] or [s, b, groups, q_per_group, d] (any strides: the packed backward's buffer is
    [b, groups, s, q_per_group, d] storage), its key slot (holding dk) in place; the value slot is left as it is.
    One kernel where ``usable``."""
    if not usable(dqkv, dq, cos, sin) or dqkv.size(-1) % 2 or dq.dtype != dqkv.dtype:
        return unrotate_into_ref_(dqkv, dq, cos, sin)
    if dqkv.numel():
        s, b, groups, qpg, d = _split(dqkv)
        dq5 = dq if dq.dim() == 5 else dq.view(s, b, groups, qpg, d)
        grid, sizes, strides, meta = _launch_args(dqkv, cos, sin)
        with _on(dqkv):
            _rotate_bwd[grid](dq5, cos, sin, dqkv, *sizes, *dq5.stride()[:4], *strides, **meta)
