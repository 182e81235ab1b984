"""The gated-GEMM SwiGLU MLP (paratron/parallel/quack_kernels.py) on CPU: its autograd function on the torch
reference operations (the interleaved [g0, u0, g1, u1, ...] layout of quack's kernels) against the
plain MLP's values and gradients, and when the MLP takes it. The kernels themselves: tests/gpu."""
import pytest
import torch
import torch.nn.functional as F

from paratron.config import parse_args
from paratron.model.layers import MLP, Norm, Parallel
from paratron.parallel import quack_kernels


def test_interleave_puts_gate_and_up_rows_in_pairs_and_back():
    w = torch.arange(12.0).view(6, 2)  # gate rows 0-2, up rows 3-5
    assert quack_kernels.interleave(w)[:, 0].tolist() == [0.0, 6.0, 2.0, 8.0, 4.0, 10.0]
    assert torch.equal(quack_kernels.deinterleave(quack_kernels.interleave(w)), w)


@pytest.mark.parametrize("with_residual", [False, True])
def test_function_matches_the_plain_mlp_in_value_and_gradients(with_residual):
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

    got_y = quack_kernels.gated_mlp(x, w1, w2, res)
    got = torch.autograd.grad(got_y, leaves, dy)
    assert got_y.shape == plain.shape == (2, 5, h)
    # the references compute in float32, as the kernels do
    assert torch.allclose(got_y, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)


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
