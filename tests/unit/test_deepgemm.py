"""The DeepGEMM switches (kernels/experimental/deepgemm.py) without a GPU: the ops' CPU paths give the reference's
numbers, the flags reach the recipe, and asking for DeepGEMM where it cannot run is refused by name."""
import dataclasses

import pytest
import torch

from paratron.config.kernels import CHOICES, KernelConfig
from paratron.errors import ConfigError
from paratron.fp8 import Recipe
from paratron.kernels import fp8_block as fb
from paratron.kernels import fp8_grouped, switches
from paratron.kernels.experimental import deepgemm
from paratron.kernels.fp8_cast import E4M3


def test_refused_by_name_where_it_cannot_run_and_never_taken_by_auto_on_cpu():
    assert "deepgemm" in CHOICES["kernel_fp8_block_gemm"] and "deepgemm" in CHOICES["kernel_fp8_block_grouped_gemm"]
    assert "Hopper" in deepgemm.refusal("cpu")
    runs = switches.resolve(KernelConfig(), "cpu", torch.bfloat16)
    assert (runs.kernel_fp8_block_gemm, runs.kernel_fp8_block_grouped_gemm) == ("dequant", "dequant")
    for name in ("kernel_fp8_block_gemm", "kernel_fp8_block_grouped_gemm"):
        asked = dataclasses.replace(KernelConfig(), **{name: "deepgemm"})
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} deepgemm: .*Hopper"):
            switches.resolve(asked, "cpu", torch.bfloat16)


def test_the_flags_reach_the_recipe():
    from paratron.train.resolve import parse_args
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--kernel-fp8-block-gemm", "deepgemm",
                      "--kernel-fp8-block-grouped-gemm", "deepgemm"])
    train = dataclasses.replace(cfg.train, fp8_format="e4m3", fp8_recipe="blockwise")
    recipe = Recipe.from_config(train, cfg.kernels)
    assert (recipe.block_gemm, recipe.block_grouped_gemm) == ("deepgemm", "deepgemm")


@pytest.mark.parametrize("b_blocks", [True, False])
def test_dense_op_off_the_gpu_is_the_emulation(b_blocks):
    torch.manual_seed(0)
    a, b = torch.randn(256, 384), torch.randn(128, 384)
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_blocks(b) if b_blocks else fb.quantize_tiles(b)
    got = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.float32, "deepgemm")
    want = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.float32, "emulate")
    assert want.norm() > 0 and torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_grouped_op_off_the_gpu_is_the_dequant_path():
    torch.manual_seed(1)
    ends = torch.tensor([100, 128, 300], dtype=torch.int32)  # (an empty second expert)
    a = torch.randn(384, 256)
    b = torch.randn(3, 128, 256) * 0.05
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_blocks(b.reshape(-1, 256))
    bq = bq.view(3, 128, 256)
    got = deepgemm.grouped_mm(aq, sa, bq, sb, ends, torch.float32)
    want = fp8_grouped.grouped_forward(aq, sa, bq, sb, ends, "block", torch.float32, "emulate")
    assert torch.allclose(got[:300], want[:300], rtol=1e-4, atol=1e-3)


def test_shapes_deepgemm_takes():
    assert deepgemm.fits(1, 128, 256) and not deepgemm.fits(128, 128, 320) and not deepgemm.fits(0, 128, 128)


def test_grouped_weight_gradient_under_deepgemm_takes_the_dequant_path():
    """DeepGEMM's Hopper grouped weight gradient wants the row counts on the host, so the experts' weight gradient
    stays on the dequant path: the same values, and zero for an expert that got no rows."""
    torch.manual_seed(2)
    ends = torch.tensor([128, 128, 384], dtype=torch.int32)  # (an empty second expert)
    gt, xt = torch.randn(256, 384), torch.randn(128, 384)
    gq, sg = fb.quantize_tiles(gt)
    xq, sx = fb.quantize_tiles(xt)
    got = fp8_grouped.grouped_wgrad(gq, sg, xq, sx, ends, "block", torch.float32, "deepgemm")
    want = fp8_grouped.grouped_wgrad(gq, sg, xq, sx, ends, "block", torch.float32, "dequant")
    assert got.shape == (3, 256, 128) and want[0].norm() > 0
    assert torch.equal(got, want) and got[1].abs().max() == 0


@pytest.mark.parametrize("installed", [True, False])
def test_auto_takes_deepgemm_where_the_pinned_build_runs(monkeypatch, installed):
    """On a Hopper GPU with CUDA >= 12.9 (faked here), auto runs DeepGEMM when it is installed at the pinned version,
    else cuBLAS's blockwise GEMM and the dequant experts; a run can still ask for those by name."""
    from paratron.kernels import fp8_block_grouped
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(deepgemm, "refusal", lambda device: None if installed else "needs DeepGEMM 2.6.1")
    dense, why = fb.gemm_choice("cuda")
    grouped, why_grouped = fp8_block_grouped.gemm_choice("cuda")
    assert (dense, grouped) == (("deepgemm", "deepgemm") if installed else ("scaled_mm", "dequant"))
    assert ("DeepGEMM 2.6.1 installed" in why) == installed and ("installed" in why_grouped) == installed


def test_the_operators_refuse_off_the_gpu_by_name():
    """The operators take DeepGEMM's dequantisation factors and run on CUDA only; mm / grouped_mm are the entry."""
    a = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    s = torch.ones(128, 1)
    with pytest.raises(RuntimeError, match="Hopper GPU with DeepGEMM 2.6.1; call .*mm / grouped_mm"):
        torch.ops.paratron.deepgemm_block_mm(a, s, a, torch.ones(1, 1), True, torch.bfloat16)
    with pytest.raises(RuntimeError, match="Hopper GPU with DeepGEMM"):
        torch.ops.paratron.deepgemm_block_grouped_mm(a, s, a.view(1, 128, 128), torch.ones(1, 1, 1),
                                                     torch.tensor([128], dtype=torch.int32), torch.bfloat16)


def test_tensorwise_experts_on_deepgemm_take_the_tensor_scale_for_every_tile_and_block():
    """--kernel-fp8-grouped-gemm deepgemm: the tensorwise forward / input gradient through DeepGEMM's grouped GEMM,
    the tensor scale repeated per tile and block (off the GPU its fallback: the dequant path), rows aligned to 128,
    the weight gradient on torch's grouped FP8 GEMM, hybrid's e5m2 gradients on bf16, refused by name on CPU."""
    from paratron.fp8 import FP8State
    from paratron.fp8 import experts as fp8_experts
    torch.manual_seed(3)
    ends = torch.tensor([128, 128, 384], dtype=torch.int32)
    a, b = torch.randn(384, 256), torch.randn(3, 256, 256) * 0.05
    aq, sa = fb.quantize_tiles(a)  # (any FP8 values: only the scales differ between the paths)
    sa, sb = torch.tensor(7.0), torch.tensor(300.0)
    bq = fb.quantize_blocks(b.reshape(-1, 256))[0].view(3, 256, 256)
    ta, tb = fp8_grouped.tensor_scales_as_blocks(sa, sb, aq.shape, bq.shape)
    assert ta.shape == (384, 2) and tb.shape == (6, 2) and (ta == 7).all() and (tb == 300).all()
    got = fp8_grouped.grouped_forward(aq, sa, bq, sb, ends, "tensor", torch.float32, "deepgemm")
    want = fp8_grouped.grouped_forward(aq, sa, bq, sb, ends, "tensor", torch.float32, "emulate")
    assert want.norm() > 0 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    tensorwise = FP8State(Recipe(format="e4m3", recipe="tensorwise", grouped_gemm="deepgemm"))
    assert fp8_experts.grouped_path(tensorwise, "tensor") == "deepgemm" and fp8_experts.alignment(tensorwise) == 128
    torch_path = FP8State(Recipe(format="e4m3", recipe="tensorwise", grouped_gemm="scaled_grouped_mm"))
    assert fp8_experts.alignment(torch_path) == 16
    hybrid = FP8State(Recipe(format="hybrid", recipe="tensorwise", grouped_gemm="deepgemm"))
    assert fp8_experts.backward_path(hybrid, "deepgemm") == "bf16"
    asked = dataclasses.replace(KernelConfig(), kernel_fp8_grouped_gemm="deepgemm")
    with pytest.raises(ConfigError, match="--kernel-fp8-grouped-gemm deepgemm: .*Hopper"):
        switches.resolve(asked, "cpu", torch.bfloat16)


def test_tensorwise_weight_gradient_under_deepgemm_takes_torchs_grouped_fp8_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *args, **kw: calls.append(kw) or torch.zeros(3, 4, 5))
    gt, xt = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(5, 256, dtype=torch.float8_e4m3fn)
    ends = torch.tensor([128, 256, 256], dtype=torch.int32)
    out = fp8_grouped.grouped_wgrad(gt, torch.tensor(2.0), xt, torch.tensor(3.0), ends, "tensor", torch.float32,
                                    "deepgemm")
    assert len(calls) == 1 and out.shape == (3, 4, 5) and out.dtype == torch.float32


def test_the_wrappers_compile_into_one_graph_and_give_the_eager_numbers():
    """mm / grouped_mm decide their path inside compiled code, the build's check first: that check must be a constant
    there, not the import probe traced (a graph break at every call: fullgraph raises). On the CPU both fall back."""
    torch.manual_seed(0)
    aq, sa = fb.quantize_tiles(torch.randn(256, 256), E4M3, 0)
    bq, sb = fb.quantize_blocks(torch.randn(128, 256), E4M3, 0)
    args = (aq, sa, bq, sb, True, torch.bfloat16)
    assert torch.equal(torch.compile(deepgemm.mm, fullgraph=True, backend="eager")(*args), deepgemm.mm(*args))
    wq, sw = fb.quantize_blocks(torch.randn(2 * 128, 256), E4M3, 0)
    args = (aq, sa, wq.view(2, 128, 256), sw, torch.tensor([128, 256], dtype=torch.int32), torch.bfloat16)
    got = torch.compile(deepgemm.grouped_mm, fullgraph=True, backend="eager")(*args)
    assert torch.equal(got, deepgemm.grouped_mm(*args))


def test_available_carries_torchs_constant_mark_without_importing_dynamo():
    """deepgemm.available is marked as torch.compiler.assume_constant_result marks a function (the compiler then
    calls it once rather than tracing its import probe), set by hand so that importing the kernel switches does not
    import torch._dynamo; this fails if torch's decorator comes to mark functions otherwise."""
    import subprocess
    import sys

    import torch
    from paratron.kernels.experimental import deepgemm

    def probe():
        return True
    marked = torch.compiler.assume_constant_result(probe)
    added = {k: v for k, v in vars(marked).items()}
    assert added and all(getattr(deepgemm.available, k, None) == v for k, v in added.items()), added
    code = ("import sys, paratron.kernels.switches, paratron.plan.search; "
            "print(any(m.startswith('torch._dynamo') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
