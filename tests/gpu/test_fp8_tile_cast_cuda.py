"""The blockwise recipe's tile cast in both layouts (kernels/fp8_tile_cast.py) on the GPU (skipped without CUDA):
every output bit for bit equal to the torch reference, and the blockwise linear and experts with the kernel equal
to the same with torch's casts, eager and compiled."""
from __future__ import annotations

import pytest
import torch

from paratron.fp8 import FP8State, Recipe
from paratron.fp8.blockwise import block_linear
from paratron.fp8.experts import fp8_grouped_mm
from paratron.kernels import fp8_tile_cast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("m,k,margin", [(4096, 8192, 0), (1000, 3000, 0), (2048, 16384, 1)])
def test_tile_cast_equals_the_reference_bit_for_bit(m, k, margin):
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4).to(torch.bfloat16)
    x[:128, :128] = 0
    got = torch.ops.paratron.fp8_tile_cast_both(x, margin)
    want = fp8_tile_cast.reference(x, margin)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8) if g.dtype != torch.float32 else g,
                           w.view(torch.uint8) if w.dtype != torch.float32 else w)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _hopper(), reason="Hopper (the blockwise GEMMs)")
@pytest.mark.parametrize("where", ["linear", "experts"])
@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_layers_with_the_kernel_equal_torch_casts(where, compiled):
    torch.manual_seed(1)
    x0 = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    w0 = (torch.randn(2, 256, 384, device="cuda") * 0.05).to(torch.bfloat16)
    ends = torch.tensor([256, 512], device="cuda", dtype=torch.int32)
    g = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for cast in ("torch", "triton"):
        state = FP8State(Recipe(format="e4m3", recipe="blockwise", block_gemm="scaled_mm", block_cast=cast))
        x, w = x0.clone().requires_grad_(), (w0[0] if where == "linear" else w0).clone().requires_grad_()
        f = (lambda a, b: block_linear(a, b, state)) if where == "linear" else \
            (lambda a, b: fp8_grouped_mm(a, b, ends, state))
        y = (torch.compile(f) if compiled else f)(x, w)
        y.backward(g)
        outs.append((y, x.grad, w.grad))
    for a, b in zip(*outs):
        if compiled:  # (Inductor may round torch's scale computation its own way)
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
        else:
            assert torch.equal(a, b)
