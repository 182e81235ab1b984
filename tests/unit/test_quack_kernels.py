"""The gated-GEMM SwiGLU MLP (paratron/kernels/quack_mlp.py) on CPU: its autograd function on the torch
reference operations (the interleaved [g0, u0, g1, u1, ...] layout of quack's kernels) against the
plain MLP's values and gradients, and when the MLP takes it. The kernels themselves: tests/gpu."""
import pytest
import torch
import torch.nn.functional as F

from paratron.config import parse_args
from paratron.model.layers import MLP, Norm, Parallel
from paratron.kernels import quack_mlp as quack_kernels, quack_norm


def test_interleave_puts_gate_and_up_rows_in_pairs_and_back():
    w = torch.arange(12.0).view(6, 2)  # gate rows 0-2, up rows 3-5
    assert quack_kernels.interleave(w)[:, 0].tolist() == [0.0, 6.0, 2.0, 8.0, 4.0, 10.0]
    assert torch.equal(quack_kernels.deinterleave(quack_kernels.interleave(w)), w)


@pytest.mark.parametrize("with_residual,keep", [(False, True), (True, True), (True, False)])
def test_function_matches_the_plain_mlp_in_value_and_gradients(monkeypatch, with_residual, keep):
    """keep: the forward's activation kept for fc2's weight gradient (else recomputed by the backward)."""
    saved = []
    monkeypatch.setattr(quack_kernels, "_dgated_keep",
                        lambda *a: saved.append(1) or quack_kernels.dgated_ref(*a[:3])[0])
    torch.manual_seed(0)
    h, f = 16, 12
    x = torch.randn(2, 5, h, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(2 * f, h, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(h, f, dtype=torch.float64, requires_grad=True)
    res = torch.randn(2, 5, h, dtype=torch.float64, requires_grad=True) if with_residual else None
    dy = torch.randn(2, 5, h, dtype=torch.float64)

    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    plain = (F.silu(gate) * up) @ w2.t() + (res if with_residual else 0)
    leaves = [t for t in (x, w1, w2, res) if t is not None]
    want = torch.autograd.grad(plain, leaves, dy)

    got_y = quack_kernels.gated_mlp(x, w1, w2, res, keep_act=keep)
    got = torch.autograd.grad(got_y, leaves, dy)
    assert got_y.shape == plain.shape == (2, 5, h)
    # the references compute in float32, as the kernels do
    assert torch.allclose(got_y, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert saved == ([1] if keep else [])


@pytest.mark.parametrize("lt", [True, False])
def test_residual_gemm_takes_the_cublaslt_switch(monkeypatch, lt):
    """--kernel-cublaslt reaches fc2's GEMM with the residual on the gated path (it was always on there)."""
    asked = []
    monkeypatch.setattr(quack_kernels, "residual_addmm", lambda c, a, w, on=True: asked.append(on) or c + a @ w.t())
    x, w1, w2, res = torch.randn(3, 8), torch.randn(12, 8), torch.randn(8, 6), torch.randn(3, 8)
    quack_kernels.gated_mlp(x, w1, w2, res, cublaslt=lt)
    assert asked == [lt]


def _cfg(*flags):
    return parse_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                       "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--mock-data", "--train-iters", "1",
                       "--lr", "1e-3", "--micro-batch-size", "2", "--device", "cpu", *flags]).model


def test_wanted_only_for_the_fused_bias_free_bf16_swiglu_on_a_gpu():
    cuda = torch.device("cuda", 0)
    quack = quack_kernels._q_gemm is not None
    assert not quack_kernels.wanted(True, False, "cpu", torch.bfloat16)  # CPU
    assert not quack_kernels.wanted(True, True, cuda, torch.bfloat16) or not quack  # biases
    assert not quack_kernels.wanted(False, False, cuda, torch.bfloat16)  # not the fused SwiGLU
    assert not quack_kernels.wanted(True, False, cuda, torch.float32)
    assert not MLP(_cfg("--swiglu", "--disable-bias-linear"), Parallel(), dtype=torch.bfloat16).gated_gemm
    assert not Norm("RMSNorm", 64, 1e-5, dtype=torch.bfloat16).quack  # CPU: the torch expression


@pytest.mark.parametrize("flags", [["--swiglu", "--disable-bias-linear"]])
def test_mlp_with_gated_gemms_gives_the_plain_output(monkeypatch, flags):
    """The MLP's wiring (fc1's input, the residual through fc2's GEMM): forced onto the gated path with
    the reference operations, it gives what the plain path gives."""
    torch.manual_seed(0)
    mlp = MLP(_cfg(*flags), Parallel(), dtype=torch.float32)
    x = torch.randn(2, 16, 64)
    res = torch.randn(2, 16, 64)
    want = mlp(x, res)
    calls = []
    monkeypatch.setattr(quack_kernels, "applies", lambda *a: calls.append(1) or True)
    mlp.gated_gemm = "cublas"
    got = mlp(x, res)
    assert calls and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_norm_keep_adds_the_residual_gradient_in_the_norm_backward():
    """rms_norm_keep's reference path: (norm(x), x) whose backward sums the norm's and the residual's
    gradients of x, as autograd does for the plain expression."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    dy, dr = torch.randn(3, 4, 32, dtype=torch.float64), torch.randn(3, 4, 32, dtype=torch.float64)
    plain = w * F.rms_norm(x, (32,), eps=1e-5)
    want = torch.autograd.grad((plain * dy).sum() + (x * dr).sum(), (x, w))
    y, r = quack_norm.rms_norm_keep(x, w, 1e-5)
    got = torch.autograd.grad((y * dy).sum() + (r * dr).sum(), (x, w))
    assert torch.allclose(y, plain, atol=1e-6) and torch.equal(r, x)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    # only the norm's output used: the residual's gradient is None in the backward
    y, _ = quack_norm.rms_norm_keep(x, w, 1e-5)
    got = torch.autograd.grad((y * dy).sum(), (x, w))
    want = torch.autograd.grad((w * F.rms_norm(x, (32,), eps=1e-5) * dy).sum(), (x, w))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))


@pytest.mark.parametrize("compiled", [False, True])
def test_layer_with_residual_keeping_norms_gives_the_plain_layer(compiled):
    """A transformer layer whose norms hand the residual on (Norm.keep, forced onto the reference of
    quack's kernels here) matches the plain layer's output and gradients, eager and compiled."""
    from paratron.model.transformer import TransformerLayer
    from paratron.model.layers import ForwardContext
    from paratron.model.spec import layer_specs
    cfg = _cfg("--swiglu", "--disable-bias-linear", "--position-embedding-type", "none", "--attention-dropout", "0",
               "--hidden-dropout", "0")
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, Parallel(), layer_specs(cfg)[0])
    x = torch.randn(16, 2, 64, requires_grad=True)
    results = []
    for keep in (False, True):
        layer.input_layernorm.quack = layer.pre_mlp_layernorm.quack = keep
        layer.zero_grad()
        x.grad = None
        run = torch.compile(layer, fullgraph=True) if compiled and keep else layer
        y = run(x, ForwardContext())
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
