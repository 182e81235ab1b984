"""Issue 46's GPU paths (skipped without CUDA): the blockwise FP8 GEMM through torch._scaled_mm's block scales
and the routed experts' FP8 GEMMs through torch._scaled_grouped_mm, each against the CPU-tested emulation of
the same FP8 operands; the fused FP8 experts MLPs (tensorwise / delayed and blockwise) against their emulation;
the MoE layer in FP8 against bf16; and no host synchronisation in the forward and backward of the dropless grouped
MoE layer (CUDA's sync debug mode set to raise)."""
from __future__ import annotations

import pytest
import torch

from paratron.fp8 import FP8State, Recipe
from paratron.fp8.experts import fp8_grouped_mm
from paratron.kernels import fp8_block as fb
from paratron.kernels import fp8_grouped
from paratron.model import moe
from paratron.model.layers import Parallel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("b_blocks", [True, False])
def test_blockwise_scaled_mm_equals_emulation(b_blocks):
    assert fb.gemm_choice("cuda")[0] == "scaled_mm", fb.gemm_choice("cuda")
    torch.manual_seed(0)
    a, b = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda")
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_blocks(b) if b_blocks else fb.quantize_tiles(b)
    got = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.bfloat16, "scaled_mm")
    want = fb.block_mm(aq, sa, bq, sb, b_blocks, torch.float32, "emulate")
    assert _rel(got, want) < 1e-2


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("k,n", [(512, 384), (384, 512)])  # (the second: the input gradient's K blocks unpadded)
@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_linear_on_the_gpu_equals_emulation(k, n, compiled):
    """Also compiled whole (fullgraph: the scaled_mm GEMM is an operator torch.compile keeps in the graph)."""
    for got, want in blockwise_linear_against_emulation(k, n, "scaled_mm", compiled):
        assert _rel(got, want) < 2e-2


def blockwise_linear_against_emulation(k: int, n: int, block_gemm: str, compiled: bool) -> list:
    """[(got, emulated)] for the blockwise FP8 linear's output and its input and weight gradients, 256 tokens of
    width ``k`` to ``n``, its GEMMs by ``block_gemm`` (compiled whole where asked)."""
    from paratron import fp8
    torch.manual_seed(1)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
    g = torch.randn(256, n, device="cuda", dtype=torch.bfloat16)
    outs = []
    for emulate in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        state = FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=emulate, block_gemm=block_gemm))
        f = lambda a, b: fp8.fp8_linear(a, b, state)  # noqa: E731
        y = (torch.compile(f, fullgraph=True) if compiled and not emulate else f)(xr, wr)
        y.backward(g)
        outs.append((y, xr.grad, wr.grad))
    return list(zip(*outs))


def _grouped_case(counts: list, k: int, n: int, align: int, std: float):
    """Rows of len(counts) experts in the padded grouped layout [size, k] (bf16), weights [E, n, k], an output
    gradient [size, n]; the real rows' places and the groups' ends."""
    counts = torch.tensor(counts, device="cuda")
    expert_index = torch.repeat_interleave(torch.arange(len(counts), device="cuda"), counts)
    dest, ends, size = moe.aligned_rows(counts, expert_index, align)
    x = torch.randn(int(counts.sum()), k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(len(counts), n, k, device="cuda") * std).to(torch.bfloat16)
    g = torch.randn(size, n, device="cuda", dtype=torch.bfloat16)
    return x.new_zeros(size, k).index_copy(0, dest, x), w, g, dest, ends


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_scaled_grouped_mm_equals_emulation(recipe):
    assert fp8_grouped.gemm_choice("cuda")[0] == "scaled_grouped_mm"
    torch.manual_seed(2)
    padded, w, g, dest, ends = _grouped_case([100, 0, 37, 250], 256, 512, 16, 0.05)
    outs = []
    for emulate in (False, True):
        xr, wr = padded.clone().requires_grad_(), w.clone().requires_grad_()
        state = FP8State(Recipe(format="e4m3", recipe=recipe, emulate=emulate, grouped_gemm="scaled_grouped_mm"))
        y = fp8_grouped_mm(xr, wr, ends, state)
        y.backward(g)
        outs.append((y[dest], xr.grad[dest], wr.grad))
    for got, want in zip(*outs):
        assert _rel(got, want) < 2e-2


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_scaled_grouped_mm_compiled_gives_the_eager_gradients(fmt):
    """torch's grouped FP8 GEMM under torch.compile (Inductor, as --torch-compile runs it) against eager, bf16
    operands: torch 2.11 traced a forward returning ``out.to(out.dtype)`` with a zero output gradient, and moe-mini's
    FP8 experts stopped learning (benchmarks/results/train_throughput_moe-mini_20261205_053620.md)."""
    torch.manual_seed(5)
    padded, w, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 3584, 16, 0.02)
    outs = []
    for compiled in (False, True):
        xr, wr = padded.clone().requires_grad_(), w.clone().requires_grad_()
        state = FP8State(Recipe(format=fmt, grouped_gemm="scaled_grouped_mm"))
        fn = torch.compile(fp8_grouped_mm) if compiled else fp8_grouped_mm
        y = fn(xr, wr, ends, state)
        y.backward(g)
        outs.append((y[dest], xr.grad[dest], wr.grad))
    for got, want in zip(outs[1], outs[0]):
        assert want.float().norm() > 0 and _rel(got, want) < 1e-2


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_grouped_triton_kernel_equals_the_dequant_path(compiled):
    """--kernel-fp8-block-grouped-gemm triton (kernels/fp8_block_grouped.py: FP8 tiles on the tensor cores) against
    the dequant path at moe-mini's expert sizes: output, input and weight gradients, eager and under torch.compile."""
    torch.manual_seed(4)
    padded, w, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 3584, 128, 0.02)
    runs = grouped_runs(padded, w, g, ends, compiled, [dict(recipe="blockwise", block_grouped_gemm=path)
                                                       for path in ("triton", "dequant")])
    for got, want in zip(*[(y[dest], gx[dest], gw) for y, gx, gw in runs]):
        assert _rel(got, want) < 1e-2


def grouped_runs(padded, w, g, ends, compiled: bool, recipes: list) -> list:
    """[(output, input gradient, weight gradient)] of ``fp8_grouped_mm`` on the padded rows for each recipe (the
    Recipe's fields besides the e4m3 format), eager or compiled."""
    runs = []
    for fields in recipes:
        xr, wr = padded.clone().requires_grad_(), w.clone().requires_grad_()
        state = FP8State(Recipe(format="e4m3", **fields))
        y = (torch.compile(fp8_grouped_mm) if compiled else fp8_grouped_mm)(xr, wr, ends, state)
        y.backward(g)
        runs.append((y, xr.grad, wr.grad))
    return runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_moe_layer_in_fp8_close_to_bf16_on_the_gpu(recipe, dtype):
    """The MoE layer's routed experts in FP8 against the same layer without, with bf16 weights and (FP8 without
    --bf16, as Megatron runs it) fp32 weights: torch's grouped / blockwise FP8 GEMMs write bf16, converted."""
    from paratron import fp8
    from paratron.kernels import switches
    from tests.unit.test_moe_dispatch import _cfg
    if not _hopper():
        pytest.skip("FP8 GEMMs: Hopper")
    torch.manual_seed(3)
    cfg = _cfg(hidden_size=256, moe_ffn_hidden_size=256, disable_bias_linear=True, moe_permute_fusion=True)
    layer = moe.MoELayer(cfg, Parallel(), device="cuda", dtype=dtype)
    x = torch.randn(256, 2, 256, device="cuda", dtype=dtype)
    ref = layer(x)
    found = switches.availability("cuda", dtype)
    fp8.attach(layer, Recipe(format="e4m3" if recipe == "blockwise" else "hybrid", recipe=recipe,
                             block_gemm=found["kernel_fp8_block_gemm"][0],
                             grouped_gemm=found["kernel_fp8_grouped_gemm"][0]))
    out = layer(x.clone().requires_grad_())
    out.float().square().sum().backward()
    assert out.dtype == dtype and layer.experts.linear_fc1.weight.grad.dtype == dtype
    assert _rel(out, ref) < 0.1 and torch.isfinite(layer.experts.linear_fc1.weight.grad).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_moe_layer_compiled_equals_eager(recipe):
    """The FP8 MoE layer compiled whole (as --torch-compile's --kernel-moe-compile layer runs it) against the same
    layer run eagerly: output and every gradient. moe-mini trained under the compiled blockwise recipe did not
    learn while the eager step did (benchmarks/results/fp8_blockwise_moe_eager_h200_20261203.md)."""
    import copy
    from paratron import fp8
    from paratron.kernels import switches
    from paratron.train.step import compile_options
    from tests.unit.test_moe_dispatch import _cfg
    if not _hopper():
        pytest.skip("FP8 GEMMs: Hopper")
    torch.manual_seed(5)
    cfg = _cfg(hidden_size=256, moe_ffn_hidden_size=384, disable_bias_linear=True, moe_permute_fusion=True)
    base = moe.MoELayer(cfg, Parallel(), device="cuda", dtype=torch.bfloat16)
    found = switches.availability("cuda", torch.bfloat16)
    x = torch.randn(512, 2, 256, device="cuda", dtype=torch.bfloat16)
    runs = []
    for compiled in (False, True):
        layer = copy.deepcopy(base)
        fp8.attach(layer, Recipe(format="e4m3", recipe=recipe, block_gemm=found["kernel_fp8_block_gemm"][0],
                                 grouped_gemm=found["kernel_fp8_grouped_gemm"][0]))
        run = torch.compile(layer, options=compile_options(torch.device("cuda"))) if compiled else layer
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.float().square().mean().backward()
        runs.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    names = ["output", "input gradient"] + [f"{n} gradient" for n, _ in base.named_parameters()]
    far = {n: round(_rel(compiled, eager), 4) for n, eager, compiled in zip(names, *runs)}
    # FP8 rounding differs where the compiler fuses the casts (1-3 % in CPU Inductor's compiled layer, both recipes);
    # the compiled blockwise step that did not learn was 62 % away in the input gradient
    assert all(v < 0.05 for v in far.values()), far  # every tensor named, not only the first that differs


@pytest.mark.parametrize("fusion", [True, False])
def test_dropless_grouped_moe_layer_never_synchronises(fusion):
    from tests.unit.test_moe_dispatch import _cfg
    torch.manual_seed(4)
    dtype = torch.bfloat16 if _hopper() else torch.float32
    layer = moe.MoELayer(_cfg(moe_permute_fusion=fusion, moe_shared_expert_intermediate_size=16), Parallel(),
                         device="cuda", dtype=dtype).train()
    x = torch.randn(64, 2, 32, device="cuda", dtype=dtype, requires_grad=True)
    layer(x).float().square().sum().backward()  # warm-up: lazy initialisations may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_fp8_experts_mlp_equals_emulation(recipe, compiled):
    """The fused FP8 experts MLP (fp8/experts_mlp.py: torch's grouped FP8 GEMMs, the Triton activation casts)
    against the same function with its GEMMs emulated (dequantised, fp32): output and every
    gradient, eager and under torch.compile, two steps (delayed: the second scaled from the histories)."""
    from paratron.fp8 import experts_mlp
    from paratron.fp8.mlp import SWIGLU
    torch.manual_seed(7)
    x, w1, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 2 * 1792, 16, 0.02)
    w2 = (torch.randn(8, 1024, 1792, device="cuda") * 0.02).to(torch.bfloat16)
    g = torch.randn(x.shape[0], 1024, device="cuda", dtype=torch.bfloat16)  # (fc2's output gradient)
    ends = torch.cat([ends[:-1], ends.new_full((1,), x.shape[0])])
    fn = torch.compile(experts_mlp.fused_experts_mlp) if compiled else experts_mlp.fused_experts_mlp
    states = {emulate: [FP8State(Recipe(format="e4m3", recipe=recipe, amax_history_len=4, emulate=emulate,
                                        grouped_gemm="scaled_grouped_mm")) for _ in range(2)]
              for emulate in (False, True)}
    for _ in range(2):
        outs = []
        for emulate in (False, True):
            xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
            y = (experts_mlp.fused_experts_mlp if emulate else fn)(xr, w1r, w2r, ends, *states[emulate], SWIGLU)
            y.backward(g)
            outs.append((y[dest], xr.grad[dest], w1r.grad, w2r.grad))
            # expert 1 has no rows: its weight gradients are zero (its group holds zero rows, not none)
            assert not w1r.grad[1].any() and not w2r.grad[1].any()
        far = {n: round(_rel(got, want), 4) for n, got, want in zip(("y", "x", "w1", "w2"), *outs)}
        # (FP8 rounding of the activation and its gradient flips where the bf16 and fp32 products differ)
        assert all(want.float().norm() > 0 for want in outs[1]) and all(v < 5e-2 for v in far.values()), far


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_grouped_wgrad_kernel_equals_the_dequant_path(compiled):
    """--kernel-fp8-block-grouped-wgrad triton (kernels/fp8_block_grouped.py: the FP8 tiles summed along each
    expert's rows) against the dequant path's weight gradient of the same operands at moe-mini's fc1 and fc2
    sizes, eager and as a custom op under torch.compile; an expert without rows gets zeros."""
    torch.manual_seed(6)
    for n, k in ((2 * 1792, 1024), (1024, 1792)):
        _, _, g, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], k, n, 128, 0.02)
        x = torch.randn(g.shape[0], k, device="cuda", dtype=torch.bfloat16)
        gtq, sgt = fb.quantize_tiles(g.t().contiguous())
        xtq, sxt = fb.quantize_tiles(x.t().contiguous())
        fn = torch.compile(fp8_grouped.grouped_wgrad) if compiled else fp8_grouped.grouped_wgrad
        got = fn(gtq, sgt, xtq, sxt, ends, "block", torch.bfloat16, "triton")
        want = fp8_grouped.grouped_wgrad(gtq, sgt, xtq, sxt, ends, "block", torch.float32, "emulate")
        assert got.shape == (8, n, k) and not got[1].any() and _rel(got, want) < 1e-2, _rel(got, want)


@pytest.mark.skipif(not _hopper(), reason="Hopper")
@pytest.mark.parametrize("path,wgrad", [("dequant", "dequant"), ("triton", "dequant"), ("dequant", "triton")])
def test_blockwise_fused_experts_mlp_equals_emulation(path, wgrad):
    """The blockwise fused experts MLP (fp8/experts_mlp.py ``_BlockExpertsMLP``: the Triton tile casts and the SwiGLU
    kernels of kernels/fp8_block_mlp.py, the grouped GEMMs by --kernel-fp8-block-grouped-gemm ``path``, the weight
    gradients by --kernel-fp8-block-grouped-wgrad ``wgrad``) against the
    same function emulated (the torch tile casts, dequantised fp32 GEMMs; the SwiGLU kernels in both, checked on
    their own in tests/gpu/test_fp8_block_mlp_cuda.py), eager, at moe-mini's expert sizes: output and every
    gradient."""
    from paratron.fp8 import experts_mlp
    from paratron.fp8.mlp import SWIGLU
    torch.manual_seed(8)
    x, w1, _, dest, ends = _grouped_case([700, 0, 333, 1100, 48, 900, 512, 503], 1024, 2 * 1792, 128, 0.02)
    w2 = (torch.randn(8, 1024, 1792, device="cuda") * 0.02).to(torch.bfloat16)
    g = torch.randn(x.shape[0], 1024, device="cuda", dtype=torch.bfloat16)
    ends = torch.cat([ends[:-1], ends.new_full((1,), x.shape[0])])
    outs = []
    for emulate in (False, True):
        r = Recipe(format="e4m3", recipe="blockwise", emulate=emulate, block_grouped_gemm=path,
                   block_grouped_wgrad=wgrad, block_cast="torch" if emulate else "triton")
        s1, s2 = FP8State(r), FP8State(r)
        assert experts_mlp.why_not(s1, s2, SWIGLU, False) is None
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = experts_mlp.fused_experts_mlp(xr, w1r, w2r, ends, s1, s2, SWIGLU)
        y.backward(g)
        outs.append((y[dest], xr.grad[dest], w1r.grad, w2r.grad))
        assert not w1r.grad[1].any() and not w2r.grad[1].any()  # expert 1 has no rows
    far = {n: round(_rel(got, want), 4) for n, got, want in zip(("y", "x", "w1", "w2"), *outs)}
    # (the kernels' exponentials and the bf16 GEMMs' rounding flip some e4m3 codes against the fp32 emulation)
    assert all(want.float().norm() > 0 for want in outs[1]) and all(v < 5e-2 for v in far.values()), far

@pytest.mark.skipif(not _hopper(), reason="Hopper")
def test_fused_fp8_experts_casts_with_a_given_scale_launch_no_amax_pass():
    """A primed delayed scaler tells the casting ops that its scale is given: they skip the amax pass and the
    scale's choice, and write the bits the preset path writes (activation, its gradient, a plain cast)."""
    from paratron.fp8.mlp import SWIGLU
    torch.manual_seed(3)
    h = torch.randn(4096, 2 * 1792, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(4096, 1792, device="cuda", dtype=torch.bfloat16)
    preset = torch.tensor(37.0, device="cuda")
    ops = torch.ops.paratron
    for given in (False, True):
        got = [ops.mlp_act_fp8(h, None, preset, SWIGLU, 0, given), ops.cast_fp8(d, preset, False, 0, given),
               ops.mlp_act_fp8_backward(h, None, d, preset, SWIGLU, False, 0, given)[:4]]
        if not given:
            want = got
    for a, b in zip(got, want):
        assert all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                               y.view(torch.uint8) if y.dtype != torch.float32 else y) for x, y in zip(a, b))
        assert a[2].item() == 37.0  # the given scale
