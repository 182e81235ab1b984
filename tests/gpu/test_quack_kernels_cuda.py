"""The gated-GEMM SwiGLU MLP on quack's kernels (Hopper, skipped elsewhere or without quack-kernels):
value and gradients against the plain bf16 path, eager and inside a compiled region, and the training
MLP of a llama-shaped model actually taking it."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels import quack_mlp as quack_kernels, quack_norm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or quack_kernels._q_gemm is None
    or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU and quack-kernels")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(m=1000, h=256, f=384):  # m not a multiple of the kernels' 128-row tiles
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, h, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(2 * f, h, device="cuda", generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(h, f, device="cuda", generator=g) * 0.05).bfloat16()
    res = torch.randn(m, h, device="cuda", generator=g).bfloat16()
    dy = torch.randn(m, h, device="cuda", generator=g).bfloat16()
    return x, w1, w2, res, dy


def _grads(fn, x, w1, w2, res, dy):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, res)]
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def _plain(x, w1, w2, res):
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return torch.addmm(res, torch.nn.functional.silu(gate) * up, w2.t())


@pytest.mark.parametrize("compiled,bwd", [(False, "cublas"), (False, "quack"), (True, "cublas")])
def test_gated_gemms_match_the_plain_path(compiled, bwd):
    args = _inputs()

    def fn(x, w1, w2, res):
        return quack_kernels.gated_mlp(x, w1, w2, res, bwd=bwd)
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    got, want = _grads(fn, *args), _grads(_plain, *args)
    for name, a, b in zip(("y", "dx", "dW1", "dW2", "dres"), got, want):
        assert a.shape == b.shape and _rel(a, b) < 1e-2, (name, _rel(a, b))


def test_llama_shaped_mlp_takes_the_gated_path(monkeypatch):
    from paratron.config import parse_args
    from paratron.model.layers import MLP, Parallel
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
                      "--ffn-hidden-size", "384", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
                      "--mock-data", "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "2"]).model
    mlp = MLP(cfg, Parallel(), device="cuda", dtype=torch.bfloat16)
    assert mlp.gated_gemm
    calls = []
    real = quack_kernels.gated_mlp
    monkeypatch.setattr(quack_kernels, "gated_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x, x).float().sum().backward()
    with torch.no_grad():
        mlp(x, x)  # generation: the plain path
    assert len(calls) == 1 and torch.isfinite(x.grad).all()


def test_rms_norm_matches_the_torch_expression_and_the_norm_takes_it():
    from paratron.model.layers import Norm
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 333, 512, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(3, 333, 512, device="cuda", generator=g).bfloat16()

    def ref(x, w):  # in fp32, one rounding
        return (w.float() * torch.nn.functional.rms_norm(x.float(), (512,), eps=1e-5)).bfloat16()

    def grads(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xl, wl)
        return [y.detach(), *torch.autograd.grad(y, (xl, wl), dy)]

    got, want = grads(lambda a, b: quack_norm.rms_norm(a, b, 1e-5)), grads(ref)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))
    norm = Norm("RMSNorm", 512, 1e-5, device="cuda", dtype=torch.bfloat16)
    assert norm.quack and not Norm("LayerNorm", 512, 1e-5, device="cuda", dtype=torch.bfloat16).quack
    assert _rel(norm(x), ref(x, norm.weight.detach())) < 1e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_norm_keep_sums_the_residual_gradient_in_its_kernel(compiled):
    """rms_norm_keep on quack's kernels: (norm(x), x) whose backward adds the residual's gradient, against
    the fp32 torch expression plus autograd's add."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, 512, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).bfloat16()
    dy, dr = (torch.randn(2, 300, 512, device="cuda", generator=g).bfloat16() for _ in range(2))

    def plain(x, w):
        return (w.float() * torch.nn.functional.rms_norm(x.float(), (512,), eps=1e-5)).bfloat16(), x

    def grads(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, r = fn(xl, wl)
        return [y.detach(), *torch.autograd.grad((y.float() * dy.float()).sum() + (r.float() * dr.float()).sum(),
                                                 (xl, wl))]

    keep = lambda a, b: quack_norm.rms_norm_keep(a, b, 1e-5)  # noqa: E731
    got, want = grads(torch.compile(keep, fullgraph=True) if compiled else keep), grads(plain)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


@pytest.mark.parametrize("spec", ["default", "256x128c1x2coop", "128x128c2x1pp"])
def test_configured_quack_gemms_match_torch(spec):
    """quack_gemm.py's ops with a tile configuration: the residual GEMM (C read by the epilogue into a new
    tensor), fc1's input gradient reading the interleaved weight, and the dgated backward."""
    from paratron.kernels import quack_gemm
    x, w1, w2, res, dy = _inputs(m=1000, h=256, f=384)
    act = torch.randn(1000, 384, device="cuda").bfloat16()
    got = quack_gemm.gemm_add(res, act, w2, spec)
    assert got.data_ptr() != res.data_ptr() and _rel(got, torch.addmm(res, act, w2.t())) < 1e-2
    dpre = torch.randn(1000, 768, device="cuda").bfloat16()
    assert _rel(quack_gemm.gemm_interleaved(dpre, w1, spec), dpre @ quack_kernels.interleave(w1)) < 1e-2
    pre, _ = quack_kernels.gated_ref(x, w1)
    for a, b in zip(quack_gemm.gemm_dgated(dy, w2, pre, spec),
                    quack_kernels.dgated_ref(dy, w2, pre)):
        assert _rel(a, b) < 1e-2


@pytest.mark.parametrize("spec", ["default", "128x160c2x1pp", "128x128c2x1pp"])
def test_dgated_without_the_activation_store_gives_quacks_gradient_bit_for_bit(spec):
    """quack_dgated's kernel (quack's dgated epilogue minus the activation's store) against quack's own."""
    from paratron.kernels import quack_gemm
    from paratron.kernels.experimental import quack_dgated
    x, w1, w2, res, dy = _inputs(m=1000, h=256, f=384)
    pre, _ = quack_kernels.gated_ref(x, w1)
    got = quack_dgated.dgated_keep(dy, w2, pre, spec)
    assert quack_dgated.available(dy) and torch.equal(got, quack_gemm.gemm_dgated(dy, w2, pre, spec)[0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_quack_accumulate_adds_the_weight_gradient_into_main_grad(interleaved):
    """quack_gemm.gemm_accumulate (TMA reduce-add into the fp32 buffer; fc1's rows to [gate; up]) against
    the fp32 product added by torch."""
    from paratron.kernels import quack_gemm
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(1000, 768, device="cuda", generator=g).bfloat16()
    x = torch.randn(1000, 256, device="cuda", generator=g).bfloat16()
    main = torch.randn(768, 256, device="cuda", generator=g)
    prod = dy.float().t() @ x.float()
    want = main + (quack_kernels.deinterleave(prod) if interleaved else prod)
    spec = quack_gemm.tile("wgrad_fc1" if interleaved else "wgrad_fc2")
    assert quack_gemm.accumulate_applies(main, dy, spec)
    quack_gemm.gemm_accumulate(main, dy, x, interleaved, spec)
    assert _rel(main, want) < 1e-5


@pytest.mark.parametrize("keep", [True, False])
def test_fused_gated_mlp_backward_fills_main_grad_like_autograd(monkeypatch, keep):
    """The gated MLP with its weights' gradients fused into main_grad (quack's accumulating GEMMs), with
    and without the kept activation: main_grad, dx and dres against the plain path's autograd gradients."""
    x, w1, w2, res, dy = _inputs()
    want = _grads(_plain, x, w1, w2, res, dy)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, res)]
    for w in leaves[1:3]:
        w.main_grad = torch.zeros(w.shape, device="cuda")
    y = quack_kernels.gated_mlp(*leaves, main_grads=(leaves[1].main_grad, leaves[2].main_grad), keep_act=keep)
    dx, _, _, dres = torch.autograd.grad(y, leaves, dy)
    for name, a, b in (("y", y, want[0]), ("dx", dx, want[1]), ("dW1", leaves[1].main_grad, want[2]),
                       ("dW2", leaves[2].main_grad, want[3]), ("dres", dres, want[4])):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))
