"""DeepGEMM's blockwise FP8 GEMMs (kernels/experimental/deepgemm.py; skipped without a Hopper GPU and the pinned
DeepGEMM) against the CPU-tested emulation of the same FP8 operands and against the dequant path: the dense GEMM
in both scale layouts, the blockwise linear forward and backward (eager and compiled whole), and the routed experts'
grouped GEMM with empty experts and rows past the last end."""
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
