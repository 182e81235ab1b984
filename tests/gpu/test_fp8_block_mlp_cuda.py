"""kernels/fp8_block_mlp.py's kernels on a GPU against their torch references (scales within the exponential's last
bits, FP8 values equal but for the rare element whose scaled value sits at a rounding boundary), and the fused
blockwise MLP (fp8/block_mlp.py) against the per-layer blockwise path, eager and compiled."""
import pytest
import torch

from paratron.kernels import fp8_block_mlp as bm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or bm.triton is None,
                                                  reason="needs CUDA and Triton")]


@pytest.mark.parametrize("grad", [False, True])
def test_kernels_match_the_references(grad):
    torch.manual_seed(0)
    h = torch.randn(4096, 2 * 1024, device="cuda", dtype=torch.bfloat16) * 3
    d = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    got = bm.swiglu_grad_tiles(h, d, 0) if grad else bm.swiglu_tiles(h, 0)
    want = bm.swiglu_grad_tiles_reference(h, d, 0) if grad else bm.swiglu_tiles_reference(h, 0)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.float32:
            assert torch.allclose(a, b, rtol=1e-5)
        else:
            assert (a.float() != b.float()).float().mean().item() < 1e-3


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_blockwise_mlp_equals_the_per_layer_path(compiled):
    from paratron.fp8 import FP8State, Recipe, block_mlp
    from paratron.fp8.linear import fp8_linear
    torch.manual_seed(1)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(2 * 2048, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(1024, 2048, device="cuda") * 0.02).to(torch.bfloat16)
    g = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)

    def per_layer(x, w1, w2, s1, s2):
        gate, up = fp8_linear(x, w1, s1).chunk(2, dim=-1)
        return fp8_linear(torch.nn.functional.silu(gate) * up, w2, s2)
    outs = []
    for fn in (block_mlp.block_mlp, per_layer):
        s1, s2 = (FP8State(Recipe(format="e4m3", recipe="blockwise", block_gemm="scaled_mm", block_cast="triton"))
                  for _ in range(2))
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = (torch.compile(fn) if compiled else fn)(xr, w1r, w2r, s1, s2)
        y.backward(g)
        outs.append((y, xr.grad, w1r.grad, w2r.grad))
    for got, want in zip(*outs):
        assert want.float().norm() > 0
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2.5e-2
