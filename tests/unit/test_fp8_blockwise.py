"""The blockwise FP8 recipe (DeepSeek-V3's scaling; paratron/kernels/fp8_block.py, paratron/fp8/blockwise.py)
on CPU: tile and block scales against hand-computed values, the quantise / dequantise round trip, the GEMM
paths against each other, the blockwise linear's three GEMMs against their hand-written definition, and the
flag's config and kernel switch."""
import pytest
import torch

from paratron import fp8
from paratron.config import ConfigError
from paratron.fp8 import E4M3, FP8State, Recipe
from paratron.kernels import fp8_block as fb
from paratron.train.resolve import parse_args

BASE = ["--mock-data", "--train-iters", "2", "--lr", "1e-3", "--micro-batch-size", "2", "--device", "cpu"]


def test_tile_scales_by_hand():
    x = torch.zeros(3, 130)
    x[0, 3], x[0, 100] = 2.0, -1.0  # tile (0, 0): amax 2 -> 448 / 2
    x[0, 129] = 0.25  # the partial tile (0, 1), two columns: 448 / 0.25
    x[1, :128] = 448.0  # amax 448 -> 1; row 1's partial tile is zero -> 1
    x[2, 128] = -3.5  # row 2: first tile zero -> 1, second 448 / 3.5 = 128
    s = fb.tile_scales(x)
    assert s.tolist() == [[224.0, 1792.0], [1.0, 1.0], [1.0, 128.0]]
    assert fb.tile_scales(x, margin=1)[0].tolist() == [112.0, 896.0]  # 448 / (amax * 2)


def test_block_scales_by_hand():
    w = torch.zeros(256, 200)
    w[5, 7] = 4.0  # block (0, 0)
    w[130, 150] = -0.5  # block (1, 1) (a partial block of 72 columns)
    w[255, 0] = 1.0  # block (1, 0)
    assert fb.block_scales(w).tolist() == [[112.0, 1.0], [448.0, 896.0]]


def test_round_trip_and_the_largest_value_of_each_tile():
    torch.manual_seed(0)
    x = torch.randn(4, 256) * torch.tensor([1e-3, 1.0, 1e2, 1e4])[:, None]
    q, s = fb.quantize_tiles(x)
    assert q.dtype == E4M3 and s.shape == (4, 2)
    tiles = q.float().abs().view(4, 2, 128).amax(dim=2)
    assert torch.equal(tiles, torch.full((4, 2), 448.0))  # every tile's amax maps to fmax exactly
    # e4m3: half a unit of 3 mantissa bits (2^-4 relative), or of the subnormal step 2^-9 (scaled units)
    bound = x.abs() * 2 ** -4 + 2 ** -10 / fb.expand(s, 4, 256, 1)
    assert ((fb.dequantize_tiles(q, s) - x).abs() <= bound).all()
    w = torch.randn(256, 384)
    wq, sw = fb.quantize_blocks(w)
    bound = w.abs() * 2 ** -4 + 2 ** -10 / fb.expand(sw, 256, 384, 128)
    assert sw.shape == (2, 3) and ((fb.dequantize_blocks(wq, sw) - w).abs() <= bound).all()


def test_tiles_keep_small_values_that_a_tensorwise_scale_loses():
    """One outlier: blockwise keeps the other tiles' values, tensorwise flushes them towards zero."""
    x = torch.full((2, 256), 1e-3)
    x[0, 0] = 1e4
    blockwise = fb.dequantize_tiles(*fb.quantize_tiles(x))
    s = fp8.compute_scale(fp8.amax(x), 448.0)
    tensorwise = fp8.dequantize(fp8.quantize(x, s, E4M3), s)
    assert torch.allclose(blockwise[1], x[1], rtol=2 ** -3) and torch.allclose(blockwise[0, 128:], x[0, 128:],
                                                                                rtol=2 ** -3)
    assert (tensorwise[1] == 0).all()


def test_block_mm_paths_agree_and_equal_the_dequantised_product():
    torch.manual_seed(1)
    a, b = torch.randn(64, 256), torch.randn(128, 256)
    aq, sa = fb.quantize_tiles(a)
    for blocks in (True, False):
        bq, sb = fb.quantize_blocks(b) if blocks else fb.quantize_tiles(b)
        ref = fb.dequantize_tiles(aq, sa) @ fb.dequantize(bq, sb, blocks).t()
        emu = fb.block_mm(aq, sa, bq, sb, blocks, torch.float32, "emulate")
        assert torch.equal(emu, ref)
        deq = fb.block_mm(aq, sa, bq, sb, blocks, torch.bfloat16, "dequant")
        assert deq.dtype == torch.bfloat16 and torch.allclose(deq.float(), ref, rtol=2e-2, atol=0.5)
        assert ((emu - a @ b.t()).norm() / (a @ b.t()).norm()) < 0.05


def test_blockwise_linear_gemms_are_the_hand_written_ones():
    """Forward x W^T with x in tiles along K and W in blocks; input gradient g W with g in tiles along N;
    weight gradient g^T x with both in tiles along the tokens."""
    torch.manual_seed(2)
    x = torch.randn(2, 128, 256, requires_grad=True)
    w = (torch.randn(384, 256) * 0.05).requires_grad_()
    g = torch.randn(2, 128, 384)
    state = FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True))
    state.trace = []
    y = fp8.fp8_linear(x, w, state)
    y.backward(g)
    x2, g2 = x.detach().reshape(-1, 256), g.reshape(-1, 384)
    deq_t = lambda t: fb.dequantize_tiles(*fb.quantize_tiles(t))  # noqa: E731
    wd = fb.dequantize_blocks(*fb.quantize_blocks(w.detach()))
    assert torch.equal(y.reshape(-1, 384), deq_t(x2) @ wd.t())
    assert torch.allclose(x.grad.reshape(-1, 256), deq_t(g2) @ wd, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, deq_t(g2.t()) @ deq_t(x2.t()).t(), rtol=1e-5, atol=1e-5)
    assert [r for r, _ in state.trace] == ["input", "weight", "grad"]
    exact = g2.t() @ x2
    assert (w.grad - exact).norm() / exact.norm() < 0.05


def test_no_fp8_wgrad_under_blockwise_keeps_the_exact_weight_gradient():
    torch.manual_seed(3)
    x, w, g = torch.randn(128, 128), (torch.randn(128, 128) * 0.1).requires_grad_(), torch.randn(128, 128)
    fp8.fp8_linear(x, w, FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True, fp8_wgrad=False))).backward(g)
    assert torch.equal(w.grad, g.t() @ x)


def test_blockwise_flag_runs_the_dense_model_and_is_not_fused(monkeypatch):
    from paratron.fp8 import mlp as fp8_mlp
    from paratron.train.loop import Trainer
    from tests.unit.test_train import losses_of
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = [*BASE, "--num-layers", "1", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "64",
             "--vocab-size", "256", "--tokenizer-type", "NullTokenizer", "--global-batch-size", "2", "--swiglu",
             "--ffn-hidden-size", "128", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    cfg = parse_args(flags)
    assert cfg.train.fp8_recipe == "blockwise"
    trainer = Trainer(cfg)
    mlp = trainer.model.module.decoder.layers[0].mlp
    assert mlp.linear_fc1.fp8.recipe.recipe == "blockwise" and mlp.linear_fc1.fp8.recipe.block_gemm == "dequant"
    assert not fp8_mlp.applies(mlp.linear_fc1, mlp.linear_fc2, fp8_mlp.SWIGLU)
    assert all(torch.isfinite(torch.tensor(losses_of(trainer, 2))))


def test_kernel_switches_resolve_on_cpu_and_reject_bad_values():
    from paratron.kernels import switches
    cfg = parse_args(BASE)
    runs = switches.resolve(cfg.kernels, "cpu", torch.bfloat16)
    assert (runs.kernel_fp8_block_gemm, runs.kernel_fp8_grouped_gemm) == ("dequant", "dequant")
    with pytest.raises(ConfigError, match="--kernel-fp8-block-gemm cutlass: choose one of auto, scaled_mm, deepgemm, dequant"):
        parse_args([*BASE, "--kernel-fp8-block-gemm", "cutlass"])
    assert Recipe.from_config(parse_args([*BASE, "--kernel-fp8-block-gemm", "scaled_mm"]).train) is None


@pytest.mark.parametrize("n,k", [(384, 512), (512, 384), (256, 1280)])
def test_scaled_mm_scale_layouts(n, k):
    """What cuBLAS's blockwise GEMM reads (torch's scaled_mm checks): a's tile scales column-major; block scales
    with their K blocks padded to a multiple of 4, then transposed; the values are the inverse scales, the
    padding past them never read as a block's scale."""
    from paratron.kernels.fp8_block import block_scales, scaled_mm_scales, tile_scales
    m = 256
    sa, sb = tile_scales(torch.randn(m, k)), block_scales(torch.randn(n, k))
    scale_a, scale_b = scaled_mm_scales(sa, sb, True)
    kb, k4 = k // 128, -(-(k // 128) // 4) * 4
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m)
    assert torch.equal(scale_a, sa.reciprocal())
    assert scale_b.shape == (k4, n // 128) and scale_b.stride() == (1, k4)
    assert torch.equal(scale_b[:kb], sb.reciprocal().t())
    # the input gradient's GEMM reads the weight's block scales transposed (a view): the same layout
    sbt = block_scales(torch.randn(k, n)).t()
    _, scale_bt = scaled_mm_scales(sa, sbt, True)
    assert scale_bt.shape == (k4, n // 128) and scale_bt.stride() == (1, k4)
    assert torch.equal(scale_bt[:kb], sbt.reciprocal().t())
    st = tile_scales(torch.randn(n, k))
    _, scale_t = scaled_mm_scales(sa, st, False)
    assert scale_t.shape == (n, kb) and scale_t.stride() == (1, n) and torch.equal(scale_t, st.reciprocal())


@pytest.mark.parametrize("shape,row_block", [((3, 130), 1), ((200, 300), 128), ((256, 384), 128), ((64, 256), 1)])
def test_casts_equal_the_per_element_scales(shape, row_block):
    """The casts broadcast each tile's scale over a view of the tile; the result is bit for bit what multiplying
    by the per-element scales (``expand``) gives, partial tiles and a transposed (non-contiguous) input too."""
    torch.manual_seed(5)
    x = torch.randn(*shape) * torch.logspace(-3, 3, shape[1])
    for t in (x, x.t().contiguous().t()):
        q, s = fb.quantize_tiles(t) if row_block == 1 else fb.quantize_blocks(t)
        full = fb.expand(s, *t.shape, row_block)
        assert q.is_contiguous() and torch.equal(q, (t * full).clamp(-448, 448).to(E4M3))
        back = fb.dequantize(q, s, row_block == fb.TILE)
        assert torch.equal(back, q.float() / full)


def test_scaled_mm_path_traces_whole_under_compile():
    """The scaled_mm GEMM is an operator of its own (torch.compile cannot trace F.scaled_mm): the blockwise linear's
    forward and backward trace as one graph (fullgraph raises on a break) and equal the dequantised path; off CUDA
    the operator computes the dequantised product."""
    torch.manual_seed(6)
    x0, w0, g = torch.randn(256, 256), torch.randn(384, 256) * 0.05, torch.randn(256, 384)
    results = []
    for path, compiled in (("dequant", False), ("scaled_mm", True)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        state = FP8State(Recipe(format="e4m3", recipe="blockwise", block_gemm=path))
        f = lambda a, b: fp8.fp8_linear(a, b, state)  # noqa: E731
        if compiled:
            f = torch.compile(f, fullgraph=True, backend="aot_eager")
        y = f(x, w)
        y.backward(g)
        results.append((y, x.grad, w.grad))
    for a, b in zip(*results):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5)
