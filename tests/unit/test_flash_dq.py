"""dq straight from FlashAttention-4's accumulator (model/flash_dq.py, rope_kernels.unrotate_accum_into_) on CPU:
the hook around a stand-in for flash_attn.cute.interface whose postprocess reads its accumulator in a hidden
order (learned, the query slots as the unfused path writes them, bit for bit), its fallbacks, and the Triton
kernel under Triton's CPU interpreter against the torch expressions. With FlashAttention-4 on a GPU:
tests/gpu/test_rope_flash_cuda.py."""
from __future__ import annotations

import functools
import types

import pytest
import torch

from paratron.model import flash_attention, flash_dq, rope_kernels as rk

S, B, GROUPS, QPG, D, TILE = 10, 2, 2, 2, 16, 4
HEADS, PER_ROW = GROUPS * QPG, 32  # the accumulator's head dimension rounded up to 32
ROWS = -(-S // TILE) * TILE


def _stand_in(order: torch.Tensor, convert_dq: bool = True):
    """A module with FlashAttention-4's ``_flash_attn_bwd`` / ``_bwd_postprocess_convert`` interface: the backward
    is the CPU reference, dQ goes through an fp32 accumulator laid out by ``order`` [TILE, D] and is converted
    (``convert_dq``) by the postprocess, which finds its compile cache by the module's name as FlashAttention-4's
    does."""
    iface = types.SimpleNamespace()

    def postprocess(accum, output, scale, cu_seqlens, seqused, arch, dtype, hdim, block_size, num_threads,
                    atom_layout, swap_ab, use_2cta_instrs=False, cluster_size=1):
        assert iface._bwd_postprocess_convert.compile_cache == "cache" and block_size == TILE and hdim == D
        s = output.size(1)
        output.copy_(rk.dq_from_accum_ref(accum, order, scale, s, output.dtype).permute(1, 0, 2, 3))

    def backward(q, k, v, out, dout, lse, scale, causal, dk=None, dv=None):
        dq32, dk32, dv32 = flash_attention.attention_bwd_ref(dout, q, k, v, out, lse, scale)
        accum = torch.zeros(B, HEADS, ROWS // TILE, TILE * PER_ROW)
        tiles = torch.zeros(B, HEADS, ROWS, D)
        tiles[:, :, :S] = dq32.float().permute(0, 2, 1, 3) / scale
        accum[..., order.flatten().long()] = tiles.view(B, HEADS, ROWS // TILE, TILE * D)
        dq = torch.empty_like(q)
        if convert_dq:
            iface._bwd_postprocess_convert(accum.view(B, HEADS, -1), dq, scale, None, None, 90, "bf16", D, TILE,
                                           256, 2, False, use_2cta_instrs=False, cluster_size=1)
        dk.copy_(dk32)
        dv.copy_(dv32)
        return dq, dk, dv

    postprocess.compile_cache = "cache"
    iface._bwd_postprocess_convert, iface._flash_attn_bwd = postprocess, backward
    return iface


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    qkv5 = torch.randn(S, B, GROUPS, QPG + 2, D, generator=g).to(dtype)
    ang = torch.randn(S, D // 2, generator=g) * 3
    cos, sin = (f(torch.cat([ang, ang], -1)) for f in (torch.cos, torch.sin))
    q, k = rk.rotate_qk_ref(qkv5, cos, sin)
    v = qkv5[:, :, :, -1]
    scale = D ** -0.5
    out, lse = flash_attention.attention_ref(*(t.transpose(0, 1) for t in (q, k, v)), scale)
    dout = torch.randn(S, B, HEADS, D, generator=g).to(dtype)
    return qkv5, cos, sin, q, k, v, out.to(dtype), lse, dout, scale


def _run(iface, fused: bool):
    """The QKV gradient: through flash_dq.backward (``fused``), or the stand-in's own dq + unrotate_into_."""
    qkv5, cos, sin, q, k, v, out, lse, dout, scale = _inputs()
    dqkv = torch.full_like(qkv5, float("nan"))
    dk, dv = dqkv[:, :, :, -2], dqkv[:, :, :, -1]
    args = (dout.transpose(0, 1), q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), out, lse, scale)
    if fused:
        dq = flash_dq.backward(*args, dk.transpose(0, 1), dv.transpose(0, 1), dqkv, cos, sin, iface=iface)
    else:
        dq = iface._flash_attn_bwd(*args[1:4], out, args[0], lse, scale, True, dk=dk.transpose(0, 1),
                                   dv=dv.transpose(0, 1))[0].transpose(0, 1)
    rk.unrotate_into_(dqkv, dq, cos, sin)
    return dq, dqkv


def test_query_slots_from_the_accumulator_are_the_unfused_ones_bit_for_bit():
    order = torch.randperm(TILE * PER_ROW, generator=torch.Generator().manual_seed(1))[:TILE * D].view(TILE, D)
    iface = _stand_in(order.to(torch.int32))
    original = iface._bwd_postprocess_convert
    dq, fused = _run(iface, True)
    assert dq is None and iface._bwd_postprocess_convert is original  # the hook is gone again
    _, want = _run(_stand_in(order.to(torch.int32)), False)
    assert not fused.isnan().any() and torch.equal(fused, want)
    rest = tuple(dict(arch=90, dtype="bf16", hdim=D, block_size=TILE, num_threads=256, atom_layout=2, swap_ab=False,
                      use_2cta_instrs=False, cluster_size=1).items())
    assert torch.equal(flash_dq._accum_order(original, rest, torch.device("cpu"), torch.bfloat16), order)


def test_falls_back_to_the_unfused_path_with_a_warning():
    order = torch.arange(TILE * D, dtype=torch.int32).view(TILE, D)
    _, want = _run(_stand_in(order), False)
    broken = _stand_in(order)
    postprocess = broken._bwd_postprocess_convert

    @functools.wraps(postprocess)
    def constant(accum, output, *args, **kwargs):  # not a permutation: every element reads the same place
        postprocess(torch.zeros_like(accum) if accum.numel() == TILE * PER_ROW else accum, output, *args, **kwargs)
    constant.compile_cache = "cache"
    broken._bwd_postprocess_convert = constant
    with pytest.warns(UserWarning, match="not a permutation"):
        dq, got = _run(broken, True)
    assert dq is not None and torch.equal(got, want)
    with pytest.warns(UserWarning, match="did not convert dQ"):
        dq, got = _run(_stand_in(order, convert_dq=False), True)
    assert dq is not None  # (the stand-in left dq unwritten: only the path taken is checked)


def test_reference_reads_a_plain_layout_as_a_reshape():
    accum = torch.randn(B, HEADS, ROWS * PER_ROW)
    plain = (torch.arange(TILE)[:, None] * PER_ROW + torch.arange(D)).to(torch.int32)
    got = rk.dq_from_accum_ref(accum, plain, 0.5, S, torch.bfloat16)
    want = (accum.view(B, HEADS, ROWS, PER_ROW)[:, :, :S, :D] * 0.5).bfloat16().permute(2, 0, 1, 3)
    assert torch.equal(got, want)


KERNEL = r"""
import torch
from paratron.model import rope_kernels as rk
torch.manual_seed(0)
# tiles of 4 / 8 rows, a head dimension rounded up in the accumulator (12 -> 32) or not (32), a last tile in part
for s, b, groups, qpg, d, per_row, tile, dtype in ((10, 2, 2, 2, 12, 32, 4, torch.bfloat16),
                                                   (8, 3, 1, 3, 32, 32, 8, torch.float16),
                                                   (5, 2, 2, 1, 8, 32, 4, torch.float32)):
    rows = -(-s // tile) * tile
    order = torch.randperm(tile * per_row)[:tile * d].view(tile, d).to(torch.int32)
    accum = torch.randn(b, groups * qpg, rows * per_row) * 5
    ang = torch.randn(s, d // 2) * 3
    cos, sin = (f(torch.cat([ang, ang], -1)) for f in (torch.cos, torch.sin))
    dqkv = torch.randn(s, b, groups, qpg + 2, d).to(dtype)
    assert rk.usable(dqkv, cos, sin)
    got = dqkv.clone()
    rk.unrotate_accum_into_(got, accum, order, 0.7, cos, sin)
    assert torch.equal(got[:, :, :, qpg:], dqkv[:, :, :, qpg:])  # key and value slots untouched
    rk.unrotate_into_(got, None, cos, sin)  # then the key slot alone
    assert torch.equal(got[:, :, :, -1], dqkv[:, :, :, -1])
    want = dqkv.clone()
    rk.unrotate_into_ref_(want, rk.dq_from_accum_ref(accum, order, 0.7, s, dtype), cos, sin)
    ok = torch.equal(got, want) if dtype != torch.float32 else torch.allclose(got, want, atol=1e-5)
    assert ok, (dtype, (got.float() - want.float()).abs().max())
print("ok")
"""


def test_kernel_matches_torch_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(KERNEL)
