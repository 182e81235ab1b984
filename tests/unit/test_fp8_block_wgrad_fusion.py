"""Megatron's gradient-accumulation fusion under ``--fp8-recipe blockwise`` on CPU: ``block_mm_accumulate`` on every
path against the dequantised product added by hand, the blockwise linear and the blockwise fused MLP adding their
weight gradients to ``main_grad`` against their unfused gradients, which recipes take the fusion, and a small GPT
trained with and without ``--no-gradient-accumulation-fusion``."""
import pytest
import torch

from paratron import fp8
from paratron.config import parse_args
from paratron.fp8 import FP8State, Recipe, block_mlp
from paratron.fp8.linear import fuses_wgrad
from paratron.kernels import fp8_block as fb
from paratron.parallel.linear import fusable_weights, fused_wgrad, mark_fusable
from paratron.parallel.tensor import ColumnParallelLinear


def _blockwise(**kw) -> FP8State:
    return FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True, **kw))


@pytest.mark.parametrize("path", fb.BLOCK_GEMMS)
def test_block_mm_accumulate_adds_the_dequantised_product(path):
    """1D1D operands (tiles along the summed dimension, a partial last tile among them); off CUDA the cuBLAS and
    DeepGEMM paths fall back to the emulation."""
    torch.manual_seed(0)
    a, b = torch.randn(96, 320), torch.randn(160, 320) * 3
    aq, sa = fb.quantize_tiles(a)
    bq, sb = fb.quantize_tiles(b)
    out0 = torch.randn(96, 160)
    want = out0 + fb.dequantize_tiles(aq, sa) @ fb.dequantize_tiles(bq, sb).t()
    out = out0.clone()
    assert fb.block_mm_accumulate(out, aq, sa, bq, sb, path) is None
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)
    assert (out - out0).abs().max() > 1  # (the product is not lost in the tolerance)


def test_dequant_accumulate_adds_the_unfused_gradient_of_the_weights_dtype():
    """On the dequant path (FP8 GPUs without cuBLAS's blockwise GEMM) the product is the unfused gradient's, a GEMM
    in the weights' dtype, then added: the unfused numbers, not an fp32 GEMM's."""
    torch.manual_seed(0)
    aq, sa = fb.quantize_tiles(torch.randn(96, 256))
    bq, sb = fb.quantize_tiles(torch.randn(128, 256))
    out0 = torch.randn(96, 128)
    out = out0.clone()
    fb.block_mm_accumulate(out, aq, sa, bq, sb, "dequant", torch.bfloat16)
    assert torch.equal(out, out0 + fb.block_mm(aq, sa, bq, sb, False, torch.bfloat16, "dequant").float())
    assert not torch.equal(out, out0 + fb.block_mm(aq, sa, bq, sb, False, torch.float32, "emulate"))


def _run_linear(x, w, g, state, main_grad, steps=2):
    """``steps`` micro-batches through the blockwise linear: (outputs, x's gradients, w's gradient of each)."""
    ys, gxs, gws = [], [], []
    for i in range(steps):
        xi = x[i].clone().requires_grad_()
        w.grad = None
        y = fp8.fp8_linear(xi, w, state, main_grad)
        y.backward(g[i])
        ys.append(y.detach())
        gxs.append(xi.grad)
        gws.append(w.grad)
    return ys, gxs, gws


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_blockwise_linear_adds_its_weight_gradient_to_main_grad(fp8_wgrad):
    """Two micro-batches: main_grad ends as its start plus each unfused gradient, added in the same order."""
    torch.manual_seed(1)
    x, g = torch.randn(2, 2, 128, 256), torch.randn(2, 2, 128, 384)
    w0 = torch.randn(384, 256) * 0.05
    main_grad0 = torch.randn(384, 256)
    plain = _run_linear(x, w0.clone().requires_grad_(), g, _blockwise(fp8_wgrad=fp8_wgrad), None)
    main_grad = main_grad0.clone()
    fused = _run_linear(x, w0.clone().requires_grad_(), g, _blockwise(fp8_wgrad=fp8_wgrad), main_grad)
    want = main_grad0
    for gw in plain[2]:
        want = want + gw
    # (fp32 sums: --no-fp8-wgrad's addmm_ rounds once less than the unfused product plus add)
    torch.testing.assert_close(main_grad, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert (main_grad - main_grad0).norm() > 0.1 * main_grad0.norm()
    for got, ref in zip(fused[0] + fused[1], plain[0] + plain[1]):
        assert torch.equal(got, ref)  # the output and the input gradient do not change
    assert all(gw is not None and gw.shape == w0.shape for gw in fused[2])  # placeholders for autograd's hooks


def test_only_the_blockwise_recipe_fuses_and_the_others_refuse_a_main_grad():
    assert fuses_wgrad(_blockwise()) and fuses_wgrad(_blockwise(fp8_wgrad=False)) and not fuses_wgrad(None)
    for recipe in ("tensorwise", "delayed"):
        state = FP8State(Recipe(format="e4m3", recipe=recipe, emulate=True))
        assert not fuses_wgrad(state)
        with pytest.raises(ValueError, match=f"the {recipe} FP8 recipe's linear does not add"):
            fp8.fp8_linear(torch.randn(16, 32), torch.randn(16, 32), state, torch.zeros(16, 32))
    layers = [ColumnParallelLinear(128, 128, bias=False) for _ in range(4)]
    mark_fusable(*layers)
    layers[1].fp8, layers[2].fp8 = _blockwise(), FP8State(Recipe(format="e4m3", recipe="tensorwise", emulate=True))
    assert fusable_weights(torch.nn.ModuleList(layers)) == [layers[0].weight, layers[1].weight, layers[3].weight]


def test_blockwise_fused_mlp_adds_both_weight_gradients_to_main_grads():
    """fc1's gradient rows come out of its GEMM as [gate; up], w1's own order: added as they are."""
    torch.manual_seed(2)
    x, g = torch.randn(256, 256), torch.randn(256, 256)
    w1, w2 = torch.randn(512, 256) * 0.05, torch.randn(256, 256) * 0.05
    mg0 = (torch.randn(512, 256), torch.randn(256, 256))
    runs = []
    for fused in (False, True):
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        mgs = tuple(m.clone() for m in mg0) if fused else (None, None)
        y = block_mlp.block_mlp(xr, w1r, w2r, _blockwise(), _blockwise(), mgs)
        y.backward(g)
        runs.append((y.detach(), xr.grad, mgs if fused else (w1r.grad, w2r.grad)))
    (y, gx, grads), (fy, fgx, main_grads) = runs
    assert torch.equal(fy, y) and torch.equal(fgx, gx)
    for got, start, want in zip(main_grads, mg0, grads):
        assert want.norm() > 0
        torch.testing.assert_close(got, start + want, rtol=1e-6, atol=1e-6)


GPT = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "128",
       "--max-position-embeddings", "128", "--vocab-size", "256", "--tokenizer-type", "NullTokenizer", "--mock-data",
       "--micro-batch-size", "1", "--global-batch-size", "2", "--swiglu", "--ffn-hidden-size", "256", "--lr", "3e-3",
       "--num-workers", "0", "--eval-iters", "0", "--log-interval", "100", "--seed", "7", "--train-iters", "3",
       "--device", "cpu", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _train(extra):
    from paratron.train.loop import Trainer
    t = Trainer(parse_args(GPT + extra))
    try:
        model = t.models[0]
        fused = {n for n, p in model.module.named_parameters() if fused_wgrad(p)}
        assert fused == {n for n, p in model.module.named_parameters() if p in model.fused_wgrad}
        losses, grads = [], []
        for _ in range(3):
            losses += t.train_step()[0].tolist()
            grads.append({n: p.main_grad.clone() for n, p in model.module.named_parameters()})
        mlp = model.module.decoder.layers[0].mlp
        path = fp8.mlp.applies(mlp.linear_fc1, mlp.linear_fc2, mlp.fp8_act)
        return fused, losses, grads, path
    finally:
        t.close()


@pytest.mark.parametrize("extra,fused_mlp", [([], False),
                                             (["--disable-bias-linear", "--kernel-fp8-weight-cache", "on"], True),
                                             (["--disable-bias-linear", "--no-fp8-wgrad"], False)])
def test_trainer_with_blockwise_fusion_equals_the_unfused_one(monkeypatch, extra, fused_mlp):
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    fused, losses, grads, path = _train(extra)
    plain, plain_losses, plain_grads, plain_path = _train(extra + ["--no-gradient-accumulation-fusion"])
    assert path == plain_path == fused_mlp  # (the blockwise fused MLP, or the per-layer linears)
    assert fused >= {f"decoder.layers.{i}.{m}.weight" for i in range(2) for m in LINEARS} and plain == set()
    torch.testing.assert_close(losses, plain_losses, rtol=1e-6, atol=0)
    for step, plain_step in zip(grads, plain_grads):
        for n, want in plain_step.items():
            assert want.norm() > 0, n
            torch.testing.assert_close(step[n], want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
