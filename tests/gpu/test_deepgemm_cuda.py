"""DeepGEMM's blockwise FP8 GEMMs (kernels/experimental/deepgemm.py; skipped without a Hopper GPU and the pinned
DeepGEMM) against the CPU-tested emulation of the same FP8 operands and against the dequant path: the dense GEMM
in both scale layouts, the blockwise linear forward and backward (eager and compiled whole), and the routed experts'
grouped GEMM with empty experts and rows past the last end; the weight gradient added into a float32 main_grad by
the accumulating 1D1D op (Megatron's gradient-accumulation fusion under the blockwise recipe)."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels import fp8_block as fb
from paratron.kernels.experimental import deepgemm

from .test_fp8_moe_cuda import _grouped_case, _rel, blockwise_linear_against_emulation, grouped_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or bool(deepgemm.refusal("cuda")),
                                                  reason="needs a Hopper GPU and DeepGEMM " + deepgemm.VERSION)]


@pytest.mark.parametrize("b_blocks", [True, False])
@pytest.mark.parametrize("k", [512, 320])  # (320: not whole tiles, taken by cuBLAS's path)
def test_deepgemm_block_mm_equals_emulation(b_blocks, k):
    torch.manual_seed(0)
    a, b = torch.randn(256, k, device="cuda"), torch.randn(384, k, device="cuda")
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_blocks(b) if b_blocks else fb.quantize_tiles(b)
    got = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.bfloat16, "deepgemm")
    want = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.float32, "emulate")
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_linear_with_deepgemm_equals_emulation(compiled):
    for got, want in blockwise_linear_against_emulation(512, 384, "deepgemm", compiled):
        assert want.float().norm() > 0 and _rel(got, want) < 2e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_deepgemm_grouped_equals_the_dequant_path(compiled):
    torch.manual_seed(4)
    padded, w, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 3584, 128, 0.02)
    padded = torch.cat([padded, padded.new_zeros(256, padded.shape[1])])  # rows past the last end
    g = torch.cat([g, g.new_zeros(256, g.shape[1])])
    runs = grouped_runs(padded, w, g, ends, compiled, [dict(recipe="blockwise", block_grouped_gemm=path)
                                                       for path in ("deepgemm", "dequant")])
    for got, want in zip(*[(y[dest], gx[dest], gw) for y, gx, gw in runs]):
        assert _rel(got, want) < 1e-2
    assert runs[0][0][-256:].abs().max().item() == 0.0  # rows no expert holds come out zero


@pytest.mark.parametrize("compiled", [False, True])
def test_tensorwise_experts_on_deepgemm_equal_torchs_grouped_fp8_gemm(compiled):
    """--kernel-fp8-grouped-gemm deepgemm: the tensorwise forward and input gradient by DeepGEMM (the tensor scale
    per tile and block), the weight gradient by torch's grouped FP8 GEMM, against torch's path throughout."""
    torch.manual_seed(5)
    padded, w, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 3584, 128, 0.02)
    runs = grouped_runs(padded, w, g, ends, compiled, [dict(recipe="tensorwise", grouped_gemm=path)
                                                       for path in ("deepgemm", "scaled_grouped_mm")])
    for got, want in zip(*[(y[dest], gx[dest], gw) for y, gx, gw in runs]):
        assert want.float().norm() > 0 and _rel(got, want) < 1e-2


@pytest.mark.parametrize("k", [512, 320])  # (320: not whole tiles, taken by cuBLAS's path)
@pytest.mark.parametrize("compiled", [False, True])
def test_mm_accumulate_adds_the_1d1d_product_in_place(k, compiled):
    torch.manual_seed(6)
    a, b = torch.randn(384, k, device="cuda"), torch.randn(256, k, device="cuda")
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_tiles(b)
    out0 = torch.randn(384, 256, device="cuda")
    out = out0.clone()
    f = torch.compile(deepgemm.mm_accumulate, fullgraph=True) if compiled else deepgemm.mm_accumulate
    f(out, aq, sa, bq, sb)
    want = out0 + fb.block_mm(aq, sa, bq, sb, False, torch.float32, "deepgemm")
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)
    assert _rel(out - out0, fb.block_mm(aq, sa, bq, sb, False, torch.float32, "emulate")) < 1e-2


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_blockwise_linear_fused_main_grad_equals_the_unfused_gradient(fp8_wgrad):
    """Two micro-batches through the DeepGEMM blockwise linear, float32 weights: main_grad against its start plus
    autograd's gradients; the input gradients unchanged. Under --no-fp8-wgrad the unfused gradient is the bf16
    GEMM's bf16 output (as Megatron's unfused path), the fused one its float32 sum: equal to bf16's rounding."""
    from paratron import fp8
    from paratron.fp8 import FP8State, Recipe
    torch.manual_seed(7)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2, 256, 384, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(384, 512, device="cuda") * 0.05
    main_grad0 = torch.randn(384, 512, device="cuda")
    runs = []
    for fused in (False, True):
        w, main_grad = w0.clone().requires_grad_(), main_grad0.clone() if fused else None
        state = FP8State(Recipe(format="e4m3", recipe="blockwise", block_gemm="deepgemm", fp8_wgrad=fp8_wgrad))
        total, gxs = main_grad0.clone(), []
        for i in range(2):
            xi, w.grad = x[i].clone().requires_grad_(), None
            fp8.fp8_linear(xi, w, state, main_grad).backward(g[i])
            gxs.append(xi.grad)
            total = main_grad if fused else total + w.grad
        runs.append((total, gxs))
    (want, gx), (got, fgx) = runs
    assert (want - main_grad0).norm() > 0 and _rel(got, want) < (1e-5 if fp8_wgrad else 2.0 ** -8)
    assert all(torch.equal(a, b) for a, b in zip(fgx, gx))
