"""cuBLASLt's ``C + A @ W^T`` into a new tensor (paratron/parallel/cublaslt.py) on a GPU (skipped elsewhere):
against torch's addmm and an fp32 reference at the step's shapes and at a strided C, C left as it was, the
fallback for operands cuBLASLt is not given, and the op inside a compiled function."""
from __future__ import annotations

import warnings

import pytest
import torch

from paratron.parallel import cublaslt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _r(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + sum(shape))
    return torch.randn(*shape, device="cuda", generator=g).bfloat16()


@pytest.mark.parametrize("m,k,n", [(4096, 8192, 2048), (1000, 2048, 2048), (64, 512, 3072)])
def test_matches_addmm_and_leaves_c_alone(m, k, n):
    a, w = _r(m, k), _r(n, k) / k ** 0.5
    c_wide = _r(m, n + 64)
    for c in (_r(m, n), c_wide[:, :n]):  # contiguous, and rows strided (a view of a wider tensor)
        before = c.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # cuBLASLt must run, not fall back
            got = cublaslt._lt_addmm(c, a, w)
        want = torch.addmm(c, a, w.t())
        ref = c.double() + a.double() @ w.double().t()
        assert got.shape == (m, n) and got.is_contiguous() and torch.equal(c, before)
        err, base = (got.double() - ref).abs().max().item(), (want.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-6, (err, base)


def test_op_falls_back_for_operands_it_is_not_given():
    a, w, c = _r(33, 7), _r(5, 7), _r(33, 5)  # rows of 7 / 5 bf16: not 16-byte strides
    assert not cublaslt._runs(c, a, w)
    assert torch.equal(cublaslt.addmm(c, a, w), torch.addmm(c, a, w.t()))
    a32 = a.float()
    assert torch.equal(cublaslt.addmm(c.float(), a32, w.float()), torch.addmm(c.float(), a32, w.float().t()))


def test_op_inside_a_compiled_function():
    a, w, c = _r(512, 1024), _r(256, 1024), _r(512, 256)
    f = torch.compile(lambda c, a, w: cublaslt.addmm(c, a, w) * 2, fullgraph=True)
    assert torch.equal(f(c, a, w), cublaslt.addmm(c, a, w) * 2)
