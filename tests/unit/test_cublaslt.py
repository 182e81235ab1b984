"""cublaslt.addmm where cuBLASLt does not run (CPUs): torch's addmm itself, eager and compiled, and the checks
that send operands there. On a GPU: tests/gpu/test_cublaslt_cuda.py."""
from __future__ import annotations

import torch

from paratron.kernels import cublaslt


def test_cpu_is_torch_addmm_eager_and_compiled():
    g = torch.Generator().manual_seed(0)
    c, a, w = (torch.randn(*s, generator=g) for s in ((6, 4), (6, 8), (4, 8)))
    assert torch.equal(cublaslt.addmm(c, a, w), torch.addmm(c, a, w.t()))
    f = torch.compile(lambda c, a, w: cublaslt.addmm(c, a, w) + 1, fullgraph=True)
    assert torch.allclose(f(c, a, w), torch.addmm(c, a, w.t()) + 1)


def test_operands_cublaslt_is_not_given():
    c, a, w = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(
        8, 8, dtype=torch.bfloat16)
    assert not cublaslt._runs(c, a, w)  # CPU tensors


def test_gradients_are_addmm_gradients():
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 3), (5, 4), (3, 4))]
    dy = torch.randn(5, 3, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(cublaslt.addmm(*leaves), leaves, dy)
    c, a, w = leaves
    want = torch.autograd.grad(torch.addmm(c, a, w.t()), leaves, dy)
    assert all(torch.allclose(x, y) for x, y in zip(got, want))


def test_mm_on_cpu_and_its_gradients():
    g = torch.Generator().manual_seed(2)
    a, w = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 4), (3, 4)))
    assert torch.equal(cublaslt.mm(a, w), torch.mm(a, w.t()))
    dy = torch.randn(5, 3, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(cublaslt.mm(a, w), (a, w), dy)
    want = torch.autograd.grad(torch.mm(a, w.t()), (a, w), dy)
    assert all(torch.allclose(x, y) for x, y in zip(got, want))


def test_no_new_plans_past_max_plans(monkeypatch):
    """Past MAX_PLANS shapes a new one is refused before any CUDA call (the ops then take torch's call)."""
    import pytest
    monkeypatch.setattr(cublaslt, "MAX_PLANS", 0)
    with pytest.raises(cublaslt._Full):
        cublaslt._plan(0, 7, 5, 3, 3, 3, 5)
