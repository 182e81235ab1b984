"""cuBLASLt's GEMMs (paratron/parallel/cublaslt.py) on a GPU (skipped elsewhere): every candidate algorithm of
the heuristic and the ops' choice against an fp64 reference (no further than twice torch's error) at the
step's shapes, C strided or not, W with rows or columns contiguous, C left as it was; the fallback for operands
cuBLASLt is not given; the ops inside a compiled function."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels import cublaslt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _r(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + sum(shape))
    return torch.randn(*shape, device="cuda", generator=g).bfloat16()


def _close(got, want, ref):
    err, base = (got.double() - ref).abs().max().item(), (want.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("m,k,n", [(4096, 8192, 2048), (1000, 2048, 2048), (64, 512, 3072)])
@pytest.mark.parametrize("w_rows", [True, False])
def test_every_candidate_and_the_choice_against_a_reference(m, k, n, w_rows):
    a = _r(m, k)
    w = _r(n, k) / k ** 0.5 if w_rows else (_r(k, n) / k ** 0.5).t()  # rows, or columns, contiguous
    for c in (_r(m, n), _r(m, n + 64)[:, :n], None):  # contiguous, rows strided, no C
        before = None if c is None else c.clone()
        ref = a.double() @ w.double().t() + (0 if c is None else c.double())
        want = torch.mm(a, w.t()) if c is None else torch.addmm(c, a, w.t())
        c_, beta = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16), 0.0) if c is None else (c, 1.0)
        plan = cublaslt._plan(0, m, n, k, k, w.stride(0 if w_rows else 1), c_.stride(0), w_rows, c is None)
        assert plan.candidates
        for algo in plan.candidates:
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cublaslt._matmul(plan, algo, 0, c_, a, w, out, beta)
            _close(out, want, ref)
        got = cublaslt.mm(a, w) if c is None else cublaslt.addmm(c, a, w)
        assert got.shape == (m, n) and got.is_contiguous()
        _close(got, want, ref)
        assert c is None or torch.equal(c, before)


def test_ops_fall_back_for_operands_they_are_not_given():
    a, w, c = _r(33, 7), _r(5, 7), _r(33, 5)  # rows of 7 / 5 bf16: not 16-byte strides
    assert not cublaslt._runs(c, a, w)
    assert torch.equal(cublaslt.addmm(c, a, w), torch.addmm(c, a, w.t()))
    assert torch.equal(cublaslt.mm(a, w), torch.mm(a, w.t()))
    assert torch.equal(cublaslt.mm(a.float(), w.float()), torch.mm(a.float(), w.float().t()))


def test_ops_inside_a_compiled_function():
    a, w, c = _r(512, 1024), _r(256, 1024), _r(512, 256)
    f = torch.compile(lambda c, a, w: cublaslt.addmm(c, a, w) * 2 + cublaslt.mm(a, w), fullgraph=True)
    assert torch.equal(f(c, a, w), cublaslt.addmm(c, a, w) * 2 + cublaslt.mm(a, w))


def test_choice_made_again_at_the_retune_call():
    a, w = _r(2048, 1024), _r(768, 1024)
    want = torch.mm(a, w.t())
    ref = a.double() @ w.double().t()
    plan = cublaslt._plan(0, 2048, 768, 1024, 1024, 1024, 768, True, True)
    for _ in range(cublaslt.RETUNE_AT + 2):
        _close(cublaslt.mm(a, w), want, ref)
    assert plan.calls == cublaslt.RETUNE_AT + 2


def test_new_shapes_past_max_plans_take_torchs_call(monkeypatch):
    monkeypatch.setattr(cublaslt, "MAX_PLANS", cublaslt._plan.cache_info().currsize)
    a, w, c = _r(96, 256), _r(40, 256), _r(96, 40)
    assert torch.equal(cublaslt.mm(a, w), torch.mm(a, w.t()))
    assert torch.equal(cublaslt.addmm(c, a, w), torch.addmm(c, a, w.t()))
