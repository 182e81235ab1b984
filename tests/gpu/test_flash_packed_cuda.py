"""The packed grouped-key attention backward (paratron/model/flash_packed.py) on Hopper, skipped elsewhere or
without flash-attn-4 4.0.0b10: its gradients against FlashAttention-4's own grouped backward (dq as the same
atomics in another order, dk / dv summed in registers instead of fp32 atomics: equal to bf16 rounding), and the
rotary attention op's backward through it against the unpacked path."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels import flash_attention, rotary as rope_kernels
from paratron.kernels.experimental import flash_packed

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not flash_packed.IMPORTED or flash_attention._fa_fwd is None
    or torch.cuda.get_device_capability()[0] != 9 or not flash_packed.pinned(),
    reason="needs a Hopper GPU and flash-attn-4 4.0.0b10")


def _close(got, want, rel):
    """Within ``rel`` of the reference's largest magnitude, element by element."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), err


@pytest.mark.parametrize("groups, heads, s, b", [(2, 8, 256, 2), (8, 32, 2048, 1)])
def test_packed_backward_matches_flashattention4(groups, heads, s, b):
    d, scale = 64, 64 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, heads, d, device="cuda", generator=g).bfloat16().transpose(0, 1)
    k, v = (torch.randn(s, b, groups, d, device="cuda", generator=g).bfloat16().transpose(0, 1) for _ in range(2))
    out, lse = flash_attention._fwd(q, k, v, scale, True)
    dout = torch.randn(s, b, heads, d, device="cuda", generator=g).bfloat16().transpose(0, 1)
    ref = tuple(flash_attention._seq_first_like(t) for t in (q, k, v))
    flash_attention._bwd_into(dout, q, k, v, out, lse, scale, *ref)
    dk, dv = (flash_attention._seq_first_like(t) for t in (k, v))
    buf = flash_packed.backward(dout, q, k, v, out, lse, scale, dk, dv)
    assert buf.shape == (b, groups, s, heads // groups, d)
    dq = buf.permute(0, 2, 1, 3, 4).reshape(b, s, heads, d)
    _close(dq, ref[0], 2e-3)
    _close(dk, ref[1], 1e-2)
    _close(dv, ref[2], 1e-2)


def test_rotary_op_backward_through_the_packed_path(monkeypatch):
    s, b, groups, qpg, d = 512, 2, 4, 4, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv5 = torch.randn(s, b, groups, qpg + 2, d, device="cuda", generator=g).bfloat16()
    ang = torch.randn(s, d // 2, device="cuda", generator=g)
    cos, sin = (f(torch.cat([ang, ang], -1)).bfloat16() for f in (torch.cos, torch.sin))
    q, k, out, lse = flash_attention._rope_fwd(qkv5, cos, sin, d ** -0.5, True, True)
    dout = torch.randn_like(out)
    want = flash_attention._rope_bwd(dout, qkv5, cos, sin, q, k, out, lse, d ** -0.5, False)  # switched off
    assert flash_packed.applies(q.transpose(0, 1), k.transpose(0, 1), dout.transpose(0, 1))
    got = flash_attention._rope_bwd(dout, qkv5, cos, sin, q, k, out, lse, d ** -0.5, True)
    _close(got[:, :, :, :qpg], want[:, :, :, :qpg], 2e-3)  # the query slots (dq rotated back)
    _close(got[:, :, :, qpg:], want[:, :, :, qpg:], 1e-2)  # the key (rotated back) and value slots
    assert rope_kernels.usable(got, cos, sin)
