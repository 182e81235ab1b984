"""The blockwise FP8 grouped GEMMs in Triton (kernels/fp8_block_grouped.py: forward / input gradient, and the weight
gradient summed along each expert's rows) against the dequantised products of the same FP8 operands, through
Triton's CPU interpreter (empty experts, rows past the last group, partial tiles), and compiled for Hopper without
a GPU."""
import pytest

CHECK = r"""
import torch
from paratron.kernels.fp8_block import E4M3, dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tiles
from paratron.kernels.fp8_block_grouped import block_grouped_mm

torch.manual_seed(0)
for counts, n, k in (([256, 0, 128], 256, 384), ([128, 128], 128, 320)):
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    s = int(ends[-1]) + 128  # a tile of rows past the last group: zeros
    x = torch.randn(s, k) * torch.rand(s, 1) * 3
    w = torch.randn(len(counts), n, k) * 0.05
    xq, sx = quantize_tiles(x, E4M3)
    wq, sw = quantize_blocks(w.reshape(-1, k), E4M3)
    wq = wq.view(len(counts), n, k)
    got = block_grouped_mm(xq, sx, wq, sw, ends, torch.float32)
    xd, wd = dequantize_tiles(xq, sx), dequantize_blocks(wq.reshape(-1, k), sw).view(len(counts), n, k)
    want = torch.zeros(s, n)
    start = 0
    for e, end in enumerate(ends.tolist()):
        want[start:end] = xd[start:end] @ wd[e].t()
        start = end
    assert got.shape == (s, n) and torch.isfinite(got).all()
    err = (got - want).norm() / want.norm()
    assert err < 1e-5, (counts, float(err))
    assert torch.equal(got[int(ends[-1]):], torch.zeros(s - int(ends[-1]), n))
    # a wrong scale anywhere shows: the product of the undivided FP8 values is far off
    assert ((xq.float() @ wq[0].float().t())[:1] - want[:1]).norm() > 10 * (got - want)[:1].norm()
    bf = block_grouped_mm(xq, sx, wq, sw, ends, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and ((bf.float() - want).norm() / want.norm()) < 1e-2
print("ok")
"""


WGRAD = r"""
import torch
from paratron.kernels.fp8_block import E4M3, dequantize_tiles, quantize_tiles
from paratron.kernels.fp8_block_grouped import block_grouped_wgrad

torch.manual_seed(2)
for counts, n, k in (([256, 0, 128], 256, 384), ([128, 384], 200, 136)):
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    s = int(ends[-1]) + 128  # a tile of rows past the last group: in no expert's sum
    g = torch.randn(s, n) * torch.rand(1, n) * 2
    x = torch.randn(s, k) * torch.rand(s, 1) * 3
    gtq, sgt = quantize_tiles(g.t().contiguous(), E4M3)  # g^T [N, S], tiles along the rows S
    xtq, sxt = quantize_tiles(x.t().contiguous(), E4M3)
    got = block_grouped_wgrad(gtq, sgt, xtq, sxt, ends, torch.float32)
    gd, xd = dequantize_tiles(gtq, sgt), dequantize_tiles(xtq, sxt)
    want, start = torch.zeros(len(counts), n, k), 0
    for e, end in enumerate(ends.tolist()):
        want[e] = gd[:, start:end] @ xd[:, start:end].t()
        start = end
    assert got.shape == (len(counts), n, k) and torch.isfinite(got).all()
    err = (got - want).norm() / want.norm()
    assert err < 1e-5, (counts, float(err))
    assert not any(c == 0 for c in counts) or torch.equal(got[counts.index(0)], torch.zeros(n, k))
    # a wrong scale anywhere shows: the sum of the undivided FP8 products is far off
    raw = gtq[:, :counts[0]].float() @ xtq[:, :counts[0]].float().t()
    assert (raw - want[0]).norm() > 10 * (got - want)[0].norm()
    bf = block_grouped_wgrad(gtq, sgt, xtq, sxt, ends, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and ((bf.float() - want).norm() / want.norm()) < 1e-2
print("ok")
"""


def test_block_grouped_wgrad_equals_the_dequantised_sums_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(WGRAD)


def test_block_grouped_gemm_equals_the_dequantised_product_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(CHECK)


EXPERTS = r"""
import torch
from paratron.fp8 import FP8State, Recipe
from paratron.fp8.experts import fp8_grouped_mm, grouped_path, wgrad_path
from paratron.kernels.fp8_block import TILE
from paratron.model.moe import aligned_rows

torch.manual_seed(1)
counts = torch.tensor([150, 0, 90])
index = torch.repeat_interleave(torch.arange(3), counts)
dest, ends, size = aligned_rows(counts, index, TILE)
x0 = torch.zeros(size, 256).index_copy(0, dest, torch.randn(int(counts.sum()), 256))
w0, g = torch.randn(3, 384, 256) * 0.05, torch.randn(size, 384)
got = {}
for name, recipe, paths in (
        ("triton", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="triton"), ("triton", "dequant")),
        ("both", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="triton", block_grouped_wgrad="triton"),
         ("triton", "triton")),
        ("emulate", Recipe(format="e4m3", recipe="blockwise", emulate=True), ("emulate", "emulate"))):
    state = FP8State(recipe)
    forward = grouped_path(state, "block")
    assert (forward, wgrad_path(state, "block", forward)) == paths
    x, w = x0.clone().bfloat16().requires_grad_(), w0.clone().bfloat16().requires_grad_()
    y = fp8_grouped_mm(x, w, ends, state)
    y.float().backward(g)
    end = int(ends[-1])
    got[name] = (y.float()[:end], x.grad.float()[:end], w.grad.float())
for name in ("triton", "both"):
    for t, r in zip(got[name], got["emulate"]):
        assert ((t - r).norm() / r.norm()) < 1e-2, (name, float((t - r).norm() / r.norm()))
print("ok")
"""


def test_blockwise_experts_through_the_kernel_equal_the_emulation_in_the_interpreter():
    """The experts' FP8 function with --kernel-fp8-block-grouped-gemm triton (forward and input gradient by the
    kernel, weight gradient by the dequant path, or with --kernel-fp8-block-grouped-wgrad triton by its kernel)
    against the fp32 emulation of the same recipe."""
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(EXPERTS)


FUSED = r"""
import torch
from paratron.fp8 import FP8State, Recipe
from paratron.fp8.experts_mlp import fused_experts_mlp, why_not
from paratron.fp8.mlp import SWIGLU
from paratron.kernels.fp8_block import TILE
from paratron.model.moe import aligned_rows

torch.manual_seed(4)
counts = torch.tensor([100, 0, 190])
index = torch.repeat_interleave(torch.arange(3), counts)
dest, ends, size = aligned_rows(counts, index, TILE)
ends = torch.cat([ends[:-1], ends.new_full((1,), size)])
x0 = torch.zeros(size, 256).index_copy(0, dest, torch.randn(int(counts.sum()), 256))
w10, w20, g = torch.randn(3, 256, 256) * 0.05, torch.randn(3, 256, 128) * 0.05, torch.randn(size, 256)
got = {}
for name, fields in (("kernels", dict(block_grouped_gemm="triton", block_grouped_wgrad="triton")),
                     ("emulate", dict(emulate=True))):
    s1, s2 = (FP8State(Recipe(format="e4m3", recipe="blockwise", **fields)) for _ in range(2))
    assert why_not(s1, s2, SWIGLU, False) is None
    x, w1, w2 = (t.clone().requires_grad_() for t in (x0, w10, w20))
    y = fused_experts_mlp(x, w1, w2, ends, s1, s2, SWIGLU)
    y.backward(g)
    got[name] = (y[dest], x.grad[dest], w1.grad, w2.grad)
assert not got["kernels"][2][1].any() and not got["kernels"][3][1].any()  # expert 1 has no rows
for t, r in zip(got["kernels"], got["emulate"]):
    assert r.norm() > 0 and ((t - r).norm() / r.norm()) < 1e-2, float((t - r).norm() / r.norm())
print("ok")
"""


def test_blockwise_fused_experts_mlp_through_both_kernels_equals_the_emulation_in_the_interpreter():
    """The blockwise fused experts MLP (fp8/experts_mlp.py) with the forward, input-gradient and weight-gradient
    GEMMs in the Triton kernels against the fp32 emulation of the same recipe: output and every gradient."""
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(FUSED)


def test_block_grouped_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    from tests.unit.test_triton_sm90 import sm90_cubin
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "ends_ptr": "*i32",
             "c_ptr": "*bf16"}
    assert len(sm90_cubin("fp8_block_grouped", "_block_grouped_kernel", types,
                          {"BM": 128, "BN": 128, "BK": 128, "EP": 16})) > 0
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "ends_ptr": "*i32",
             "c_ptr": "*bf16"}
    assert len(sm90_cubin("fp8_block_grouped", "_block_wgrad_kernel", types, {"BM": 128, "BN": 128, "BS": 128})) > 0


@pytest.mark.parametrize("field,choices", [("block_grouped_gemm", ("auto", "deepgemm", "triton", "dequant")),
                                           ("block_grouped_wgrad", ("auto", "triton", "dequant"))])
def test_switch_auto_keeps_dequant_and_triton_is_refused_without_a_gpu(field, choices):
    """--kernel-fp8-block-grouped-gemm and --kernel-fp8-block-grouped-wgrad: auto keeps dequant, triton is refused by
    name without Triton and a GPU, and the flag reaches the recipe."""
    import dataclasses
    import torch
    from paratron.config.kernels import CHOICES, KernelConfig
    from paratron.errors import ConfigError
    from paratron.fp8 import Recipe
    from paratron.kernels import switches
    from paratron.train.resolve import parse_args
    name, flag = f"kernel_fp8_{field}", f"--kernel-fp8-{field.replace('_', '-')}"
    assert CHOICES[name] == choices
    assert getattr(switches.resolve(KernelConfig(), "cpu", torch.bfloat16), name) == "dequant"
    asked = dataclasses.replace(KernelConfig(), **{name: "triton"})
    with pytest.raises(ConfigError, match=f"{flag} triton: the kernel needs Triton"):
        switches.resolve(asked, "cpu", torch.bfloat16)
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", flag, "triton"])  # (FP8 needs a GPU)
    train = dataclasses.replace(cfg.train, fp8_format="e4m3", fp8_recipe="blockwise")
    assert getattr(Recipe.from_config(train, cfg.kernels), field) == "triton"  # the flag reaches the recipe
    assert getattr(Recipe.from_config(train, KernelConfig()), field) == "dequant"


def test_wgrad_kernel_loads_are_pipelined_for_sm90():
    """Compiled as a launch specialises it (pointers and sizes divisible by 16, unit strides constant), the weight
    gradient's loop loads asynchronously into several stages: without the loop start declared a multiple of 128
    (``tl.multiple_of``) its loads were neither vectorised nor pipelined (one 32 KB stage, no cp.async)."""
    pytest.importorskip("triton")
    from paratron.kernels import fp8_block_grouped
    from tests.unit.test_triton_sm90 import compile_sm90
    kernel = getattr(fp8_block_grouped, "_block_wgrad_kernel", None)
    if kernel is None:
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "ends_ptr": "*i32",
             "c_ptr": "*bf16"}
    unit = {"sas": 1, "ssas": 1, "sbs": 1, "ssbs": 1, "sck": 1}
    aligned = [n for n in kernel.arg_names if n not in unit and n not in ("BM", "BN", "BS")]
    k = compile_sm90(kernel, types, {"BM": 128, "BN": 128, "BS": 128, **unit}, aligned=aligned, num_warps=8)
    assert "cp.async" in k.asm["ptx"] and k.metadata.shared >= 2 * 2 * 128 * 128, k.metadata.shared
