"""The Triton kernels of paratron/kernels/cross_entropy.py (the fused cross-entropy pass and the row scaling of
its backward) against the torch expressions they replace, run through Triton's CPU interpreter (they run on
CUDA in tests/gpu/test_cross_entropy_cuda.py, where the roundings are compared bit for bit). The interpreter
rounds fp32 -> bf16 by truncation and computes exp / log with numpy, so here a bf16 result may be one unit
in the last place away from torch's."""
import pytest
import torch
import torch.nn.functional as F

from paratron.parallel import cross_entropy as ce

from paratron.kernels import cross_entropy as kce

pytest.importorskip("triton")

from tests.interpret import interpret as _interpret  # noqa: E402

FUSED = r"""
import torch
from paratron.parallel import cross_entropy as ce
from paratron.kernels import cross_entropy as kce
torch.manual_seed(0)


def within_one_ulp(got, want):
    # got (bf16/fp16/fp32) is want (fp32) rounded either way: one unit in the last place of got's dtype, plus
    # numpy's exp against torch's: a few fp32 units, and anything among fp32's subnormals
    f, f32 = torch.finfo(got.dtype), torch.finfo(torch.float32)
    ulp = (want.abs() + f.tiny) * f.eps + want.abs() * 4 * f32.eps + f32.tiny
    return bool(((got.float() - want).abs() <= ulp).all())


# rows: the max in the first block / the last (partial) block / both signs at +-80 / all equal; targets in the
# first and last columns; vocabulary 1000 = 3 blocks of 256 + 232; a row stride wider than the vocabulary
n, v, block = 6, 1000, 256
cases = ((torch.bfloat16, 0), (torch.float32, 0), (torch.float16, 300))
# FAST (the GPU's approximate exp) and not: under the interpreter both are numpy's exp, so this runs FAST's branch;
# tests/gpu/test_cross_entropy_cuda.py compares the two exps
for fast, (dtype, vocab_start) in [(f, c) for f in (False, True) for c in cases]:
    wide = (torch.randn(n, v + 24) * 4).to(dtype)
    wide[0, 3] = 30
    wide[1, 990] = 30
    wide[2, 500], wide[2, 501], wide[2, 999] = 80, -80, 80
    wide[3] = -2.5
    logits = wide[:, :v]
    target = torch.tensor([0, 999, 999, 17, 500, 640]) + vocab_start
    if vocab_start:  # targets outside this rank's columns (the TP case): masked out, 0 picked
        target[4], target[5] = 5, vocab_start + v
    local = target - vocab_start
    m, sum_exp, picked = ce._ce_stats(logits, local, v)
    want_lse = m + sum_exp.log()
    before = wide.clone()
    lse, loss = kce.fused_ce_(logits, target, vocab_start, block=block, num_warps=4, fast=fast)
    assert lse.dtype == loss.dtype == torch.float32
    assert torch.allclose(lse, want_lse, rtol=0, atol=2e-6), (dtype, (lse - want_lse).abs().max())
    assert torch.equal(loss, lse - picked), dtype  # the target logit is exact
    # the gradient from the kernel's own lse: the same fp32 values, rounded to the logits' dtype
    want = (before[:, :v].float() - lse[:, None]).exp()
    inside = (local >= 0) & (local < v)
    want[inside, local[inside]] -= 1.0
    assert within_one_ulp(wide[:, :v], want), dtype
    assert torch.equal(wide[:, v:], before[:, v:]), dtype  # beyond the vocabulary: untouched
    grad_sum = wide[:, :v].float().sum(-1)  # softmax - onehot sums to 0 (to 1 where the target is elsewhere)
    assert torch.allclose(grad_sum, 1 - inside.float(), atol=0.05), (dtype, grad_sum)
print("ok")
"""


def test_fused_cross_entropy_kernel_matches_the_two_passes_in_the_interpreter():
    _interpret(FUSED)


SCALE = r"""
import torch
from paratron.parallel import cross_entropy as ce
from paratron.kernels import cross_entropy as kce
torch.manual_seed(0)


def cut(x):
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


n, h = 5, 300  # h: two blocks of 256, the second partial
for dtype in (torch.bfloat16, torch.float16):
    t = (torch.randn(n, h) * 3).to(dtype)
    for g in (torch.rand(n, 1) * 5, torch.full((1, 1), 0.37).expand(n, 1)):  # the second: row stride 0
        exact = t.float() * g  # the one fp32 product torch's (t * g).to(dtype) rounds
        want = cut(exact) if dtype == torch.bfloat16 else exact.to(dtype)  # (the interpreter truncates to bf16)
        out = kce.scale_rows(t, g, torch.empty_like(t), block=256, num_warps=4)
        assert out.dtype == dtype and torch.equal(out, want), dtype
        same = t.clone()
        assert kce.scale_rows(same, g, same, block=256, num_warps=4) is same and torch.equal(same, want), dtype
print("ok")
"""


def test_row_scaling_kernel_matches_torch_in_the_interpreter():
    _interpret(SCALE)


WHOLE = r"""
import torch
import torch.nn.functional as F
from paratron.parallel import cross_entropy as ce
from paratron.kernels import cross_entropy as kce
torch.manual_seed(0)
x = torch.randn(7, 16).bfloat16().requires_grad_()
w = torch.randn(300, 16).bfloat16().requires_grad_()
t = torch.tensor([0, 299, 5, 7, 100, 200, 299])
g = torch.rand(7)


def run():
    x.grad = w.grad = None
    loss = ce.linear_cross_entropy(x, w, t)
    (loss * g).sum().backward()
    return loss.detach(), x.grad, w.grad


eager = run()
calls = []
fused, ce._fusable = ce.fused_ce_, lambda *a: True  # the CUDA path's kernel, on CPU tensors


def counted(*a, **k):
    calls.append(1)
    return fused(*a, block=128, num_warps=4)


ce.fused_ce_ = counted
mine = run()
assert calls == [1]
assert (mine[0] - eager[0]).abs().max() < 1e-5
for a, b in zip(mine[1:], eager[1:]):  # (the kept gradient may differ by one bf16 unit: truncated here)
    assert a.dtype == torch.bfloat16 and ((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
print("ok")
"""


def test_linear_cross_entropy_through_the_fused_kernel_matches_eager_in_the_interpreter():
    _interpret(WHOLE)


def test_row_scaling_off_cuda_is_torchs_expression():
    t = torch.randn(4, 6).bfloat16()
    g = torch.rand(4, 1)
    assert torch.equal(kce.row_scaled(t, g), (t * g).to(t.dtype))
    assert torch.equal(kce.row_scaled(t, g, inplace=True), (t * g).to(t.dtype))
    assert not ce._fusable(t, None, 4, 4, True, "triton")  # no CUDA: the two-pass code


LOGITS = r"""
import torch
import torch.nn.functional as F
from paratron.parallel import cross_entropy as ce
torch.manual_seed(0)
x = torch.randn(3, 4, 16).bfloat16().requires_grad_()  # [s, b, h], as BERT's output layer takes it
w = torch.randn(300, 16).bfloat16().requires_grad_()
b = torch.randn(300).bfloat16().requires_grad_()
t = torch.tensor([[0, 299, 5, 7], [100, 200, 299, 1], [3, 3, 250, 0]])
g = torch.rand(3, 4)


def run():
    x.grad = w.grad = b.grad = None
    logits = F.linear(x, w, b)
    loss = ce.logits_cross_entropy(logits, t)
    (loss * g).sum().backward()
    return loss.detach(), x.grad, w.grad, b.grad


eager = run()
assert not ce._logits_fusable(torch.zeros(2, 3).bfloat16(), None, "triton")  # no CUDA: torch's cross-entropy
calls = []
fused = ce.fused_ce_


def counted(*a, **k):
    calls.append(1)
    return fused(*a, block=128, num_warps=4, fast=k["fast"])


ce.fused_ce_, ce._logits_fusable = counted, lambda *a: True  # the CUDA path's kernel, on CPU tensors
mine = run()
assert calls == [1]
assert mine[0].shape == (3, 4) and (mine[0] - eager[0]).abs().max() < 1e-5
for a, e in zip(mine[1:], eager[1:]):  # (the logits' gradient rounded twice: softmax - onehot, then times g)
    assert a.dtype == torch.bfloat16 and ((a.float() - e.float()).norm() / e.float().norm()) < 1e-2
print("ok")
"""


def test_logits_cross_entropy_through_the_fused_kernel_matches_torchs_in_the_interpreter():
    _interpret(LOGITS)


def test_logits_cross_entropy_off_cuda_is_the_vocab_parallel_one():
    logits = torch.randn(3, 2, 50, requires_grad=True)
    t = torch.randint(0, 50, (3, 2))
    want = F.cross_entropy(logits.detach().flatten(0, 1), t.flatten(), reduction="none").view(3, 2)
    got = ce.logits_cross_entropy(logits, t)
    assert torch.allclose(got, want)
    got.sum().backward()
    assert torch.allclose(logits.grad, torch.softmax(logits.detach(), -1) - F.one_hot(t, 50), atol=1e-6)
