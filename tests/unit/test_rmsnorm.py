"""paratron/model/rmsnorm.py: the RMSNorm with a hand-written backward against autograd of the torch
expression it replaces (its CPU path here, the Triton kernel through Triton's CPU interpreter), and
``Norm``'s choice between the two."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from paratron.model import layers
from paratron.model.rmsnorm import rms_norm, rms_norm_reference

EPS = 1e-5


def _reference(x, w, dy, dtype):
    """Output and (dx, dw) by autograd of the torch expression, computed in ``dtype``."""
    xr = x.detach().to(dtype).requires_grad_()
    wr = w.detach().to(dtype).requires_grad_()
    y = wr * F.rms_norm(xr, (x.size(-1),), eps=EPS)
    y.backward(dy.to(dtype))
    return y.detach(), xr.grad, wr.grad


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_backward_op_matches_autograd(dtype, tol):
    x, w, dy = _inputs((3, 5, 48), dtype)
    rstd = torch.rsqrt(x.to(torch.promote_types(dtype, torch.float32)).pow(2).mean(-1) + EPS)
    dx, dw = torch.ops.paratron.rms_norm_backward(dy, x, w, rstd)
    _, rdx, rdw = _reference(x, w, dy, torch.float64)
    assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
    assert _rel(dx, rdx) < tol and _rel(dw, rdw) < tol, (_rel(dx, rdx), _rel(dw, rdw))


def test_function_in_bf16_matches_the_torch_expression():
    """Forward and backward of ``_RMSNorm`` (CPU: the op's torch path) in bf16: the forward equals the
    old expression; the gradients are as close to a float64 reference as the old expression's."""
    from paratron.model.rmsnorm import _RMSNorm
    x, w, dy = _inputs((4, 7, 96), torch.bfloat16)
    outs = []
    for fn in (lambda a, b: _RMSNorm.apply(a, b, EPS), lambda a, b: rms_norm_reference(a, b, EPS)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(dy)
        outs.append((y.detach(), xa.grad, wa.grad))
    _, rdx, rdw = _reference(x, w, dy, torch.float64)
    assert _rel(outs[0][0], outs[1][0]) < 1e-3  # equal but for rare last-bit flips of rsqrt
    for i, want in ((1, rdx), (2, rdw)):
        ours, old = _rel(outs[0][i], want), _rel(outs[1][i], want)
        assert outs[0][i].dtype == torch.bfloat16 and ours < 1e-2 and ours <= 1.5 * old + 1e-3, (i, ours, old)


def test_function_forward_is_the_expression_and_backward_flows_through_the_op():
    """The autograd.Function on CPU tensors (rms_norm itself takes the torch path off CUDA)."""
    from paratron.model.rmsnorm import _RMSNorm
    x, w, dy = _inputs((6, 40), torch.float32, seed=1)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _RMSNorm.apply(xa, wa, EPS)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, torch.float64)
    assert torch.allclose(y, rms_norm_reference(x, w, EPS), rtol=1e-6, atol=1e-6)
    assert _rel(xa.grad, rdx) < 2e-6 and _rel(wa.grad, rdw) < 2e-6
    assert rms_norm(x, w, EPS).equal(rms_norm_reference(x, w, EPS))  # CPU: the expression
    # traceable in one graph by torch.compile (the op's fake kernel), with the same gradients
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.compile(lambda a, b: _RMSNorm.apply(a, b, EPS), backend="aot_eager", fullgraph=True)(xc, wc).backward(dy)
    assert _rel(xc.grad, rdx) < 2e-6 and _rel(wc.grad, rdw) < 2e-6


CHECK = r"""
import torch, torch.nn.functional as F
from paratron.model.rmsnorm import rms_norm_backward_triton, launch_shape
assert launch_shape(2048) == (2048, 4, 8) and launch_shape(16384)[:2] == (16384, 1)
g = torch.Generator().manual_seed(0)
# h not a power of two, rows not a multiple of BLOCK_ROWS, leading dims, several tiles per program
for shape, dtype, tol, progs in (((3, 7, 100), torch.float32, 2e-6, 3), ((13, 40), torch.bfloat16, 1e-2, 2),
                                 ((5, 2, 264), torch.bfloat16, 1e-2, 64), ((0, 16), torch.float32, 0.0, 4)):
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
    dx, dw = rms_norm_backward_triton(dy, x, w, rstd, max_programs=progs)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (wr * F.rms_norm(xr, (shape[-1],), eps=1e-5)).backward(dy.double())
    assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
    for got, want in ((dx, xr.grad), (dw, wr.grad)):
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= tol, (shape, dtype, err)
print("ok")
"""


def test_triton_kernel_matches_torch_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


class _Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, to see which path ``Norm`` takes."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("env,kind,zero,triton,want", [
    (None, "RMSNorm", False, True, True), ("torch", "RMSNorm", False, True, False),
    (None, "RMSNorm", True, True, False), (None, "LayerNorm", False, True, False),
    (None, "RMSNorm", False, False, False)])
def test_norm_picks_the_triton_backward_only_for_plain_rmsnorm(monkeypatch, env, kind, zero, triton, want):
    if env is None:
        monkeypatch.delenv("PARATRON_RMSNORM", raising=False)
    else:
        monkeypatch.setenv("PARATRON_RMSNORM", env)
    calls = []
    monkeypatch.setattr(layers, "rms_norm", lambda x, w, eps: calls.append(eps) or rms_norm_reference(x, w, eps))
    monkeypatch.setattr(layers, "triton_available", lambda: triton)
    norm = layers.Norm(kind, 16, EPS, zero_centered=zero)
    monkeypatch.setenv("PARATRON_RMSNORM", "torch" if env is None else "")  # read once, in __init__
    x = torch.randn(3, 16)
    norm(x)  # a CPU tensor: never the Triton path
    assert calls == []
    norm(x.as_subclass(_Cuda))
    assert calls == ([EPS] if want else [])
