"""kernels/fp8_block_mlp.py: the blockwise SwiGLU and its gradient written straight into FP8 tiles. In Triton's CPU
interpreter (fp32 outputs keep the scaled values before the FP8 conversion) the kernels' scales and values match the
torch references' within the exponential's last bits, partial and zero tiles included; the kernels compile for
Hopper; off CUDA the ops are the references, which match autograd's SwiGLU gradient; shapes it cannot take are
refused in one line."""
import pytest
import torch

from paratron.kernels import fp8_block_mlp as bm
from paratron.kernels.fp8_block import dequantize_tiles

CHECK = r"""
import torch
from paratron.kernels.fp8_block import _scaled
from paratron.kernels.fp8_cast import E4M3, FMAX, SWIGLU, activation, activation_grad
from paratron.kernels.fp8_block_mlp import TILE, _ceil, _swiglu_tiles, swiglu_tiles_reference

torch.manual_seed(0)
fmax = FMAX[E4M3]
def close(a, b):
    return torch.allclose(a, b, rtol=2e-6, atol=1e-6)
for m, f, margin in ((200, 256, 0), (256, 128, 1)):
    h = (torch.randn(m, 2 * f) * 3).to(torch.bfloat16)
    h[:128, :128] = 0  # a zero tile of the output (gate 0) and of the gate's gradient
    d = torch.randn(m, f).to(torch.bfloat16)
    for grad in (False, True):
        n = 2 * f if grad else f
        q, qt = torch.empty(m, n), torch.empty(n, m)
        s, st = torch.empty(m, _ceil(n)), torch.empty(n, _ceil(m))
        _swiglu_tiles[(_ceil(m), _ceil(f))](h, d, q, s, qt, st, m, f, _ceil(m), 2.0 ** margin, FMAX_=fmax, T=TILE,
                                            GRAD=grad)
        a = activation_grad(h.float(), d.float(), SWIGLU) if grad else activation(h.float(), SWIGLU)
        from paratron.kernels.fp8_block_mlp import _both
        _, ws, _, wst = _both(a, margin)
        assert close(s, ws) and close(st, wst), (m, f, grad, (s - ws).abs().max(), (st - wst).abs().max())
        assert close(q, _scaled(a, s, 1, divide=False).clamp(-fmax, fmax)), (m, f, grad)
        assert close(qt, _scaled(a.t(), st, 1, divide=False).clamp(-fmax, fmax)), (m, f, grad)
        z = f // TILE if grad else 0  # the zero tile: the output's where the gate is 0, else the up's gradient
        assert (s[:128, z] == 1).all() and (st[z * TILE:(z + 1) * TILE, 0] == 1).all()
print("ok")
"""


def test_kernels_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(CHECK)


def test_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from tests.unit.test_triton_sm90 import sm90_cubin
    types = {"h_ptr": "*bf16", "d_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv",
             "st_ptr": "*fp32", "MULT": "fp32"}
    for grad in (False, True):
        assert len(sm90_cubin("fp8_block_mlp", "_swiglu_tiles", types, {"FMAX_": 448.0, "T": 128, "GRAD": grad})) > 0


def test_the_references_hold_swiglu_and_its_autograd_gradient():
    torch.manual_seed(1)
    h = torch.randn(256, 512, requires_grad=True)
    d = torch.randn(256, 256)
    gate, up = h.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(d)
    q, s, qt, st = bm.swiglu_tiles(h.detach(), 0)
    want = torch.nn.functional.silu(gate.detach()) * up.detach()
    assert torch.allclose(dequantize_tiles(q, s), want, rtol=0.07, atol=1e-3)  # (e4m3: 3 mantissa bits)
    assert torch.allclose(dequantize_tiles(qt, st), want.t(), rtol=0.07, atol=1e-3)
    gq, gs, gqt, gst = bm.swiglu_grad_tiles(h.detach(), d, 0)
    assert gq.shape == (256, 512) and gqt.shape == (512, 256)
    assert torch.allclose(dequantize_tiles(gq, gs), h.grad, rtol=0.07, atol=1e-3)
    assert torch.allclose(dequantize_tiles(gqt, gst), h.grad.t(), rtol=0.07, atol=1e-3)


def test_widths_it_cannot_tile_are_refused():
    with pytest.raises(ValueError, match=r"F a multiple of 128, got \(4, 200\)"):
        bm.swiglu_tiles(torch.zeros(4, 200), 0)


def test_the_fused_blockwise_mlp_equals_the_per_layer_path():
    """fp8/block_mlp.py against fc1 -> SwiGLU -> fc2 as three blockwise steps (fp8/blockwise.py), emulated: the same
    output and gradients up to the SwiGLU's output and gradient being quantised from fp32 rather than bf16."""
    from paratron.fp8 import FP8State, Recipe
    from paratron.fp8 import block_mlp
    from paratron.fp8.linear import fp8_linear
    torch.manual_seed(2)
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    w1 = (torch.randn(512, 256) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(256, 256) * 0.05).to(torch.bfloat16)
    g = torch.randn(256, 256, dtype=torch.bfloat16)
    outs = []
    for fused in (True, False):
        s1, s2 = (FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True)) for _ in range(2))
        assert block_mlp.applies(s1, s2, True, False) and not block_mlp.applies(s1, s2, True, True)
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        if fused:
            y = block_mlp.block_mlp(xr, w1r, w2r, s1, s2)
        else:
            gate, up = fp8_linear(xr, w1r, s1).chunk(2, dim=-1)
            y = fp8_linear(torch.nn.functional.silu(gate) * up, w2r, s2)
        y.backward(g)
        outs.append((y, xr.grad, w1r.grad, w2r.grad))
    for got, want in zip(*outs):
        assert got.dtype == want.dtype and want.float().norm() > 0
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2.5e-2  # (1.4 % seen)
