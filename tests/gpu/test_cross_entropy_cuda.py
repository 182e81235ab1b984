"""The CUDA path of paratron/parallel/cross_entropy.py: the fused Triton cross-entropy pass against the compiled
two passes it replaces (``_ce_stats`` + ``_ce_grad``: bit for bit where they compute the same fp32 operations),
the row-scaling kernel against torch's ``(t * g).to(t.dtype)`` (bit for bit), and ``linear_cross_entropy`` at a
llama-1b-like size (4096 tokens x 2048 hidden x 32768 vocabulary, bf16) against an fp32 reference, against the
two-pass code, and its backward against the expressions it replaced (bit for bit)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("v, vocab_start", [(32768, 0), (32000, 0), (128256, 0), (32768, 16384), (1000, 0)])
def test_fused_kernel_matches_the_compiled_two_passes(v, vocab_start):
    """With libdevice's exp (bit for bit where the same fp32 operations run), then the GPU's approximate exp.
    32000: a last block shorter than the kernel's; 128256: llama-3's vocabulary; a vocab_start with targets
    outside the shard (not on the fused path in training, which is TP=1, but the kernel masks them); 1000: a row
    shorter than one block."""
    from paratron.parallel import cross_entropy as ce
    from paratron.kernels import cross_entropy as kce
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 2048
    logits = (torch.randn(n, v, device="cuda", generator=gen) * 3).bfloat16()
    logits[:8, -1] = 80  # the max in the last block (the running sums rescaled), a target there
    logits[8:16, 0] = 80  # the max in the first block
    logits[16, 1], logits[16, 2] = 80, -80
    target = torch.randint(0, v, (n,), device="cuda", generator=gen) + vocab_start
    target[:4] = vocab_start + v - 1
    if vocab_start:
        target[1::3] = torch.randint(0, vocab_start, (len(target[1::3]),), device="cuda", generator=gen)
    local = target - vocab_start
    stats, grad = ce._kernel(ce._ce_stats, logits), ce._kernel(ce._ce_grad, logits)
    m, sum_exp, picked = stats(logits, local, v)
    want_lse = m.float() + sum_exp.float().log()
    d = logits.clone()
    lse, loss = kce.fused_ce_(d, target, vocab_start, fast=False)
    # the sum of exp: other summation order and rescalings (a few fp32 units); max and target logit exact
    assert (lse - want_lse).abs().max().item() <= 2e-5
    assert torch.equal(loss, lse - picked.float())
    # from the same lse the gradient is the same fp32 arithmetic, rounded to nearest even: bit-identical
    assert torch.equal(d, grad(logits, lse, local, v))
    other = grad(logits, want_lse, local, v)  # with the two passes' own lse: rare one-unit differences
    assert (d != other).float().mean().item() < 1e-2 and _rel(d, other) < 1e-3
    fast = logits.clone()  # the GPU's approximate exp: the same up to rare one-unit differences
    lse_fast, loss_fast = kce.fused_ce_(fast, target, vocab_start, fast=True)
    assert (lse_fast - want_lse).abs().max().item() <= 2e-5 and torch.equal(loss_fast, lse_fast - picked.float())
    assert (fast != other).float().mean().item() < 1e-2 and _rel(fast, other) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_scaling_is_bit_identical_to_torch(dtype):
    from paratron.parallel import cross_entropy as ce
    from paratron.kernels import cross_entropy as kce
    gen = torch.Generator(device="cuda").manual_seed(1)
    t = (torch.randn(4096, 2050, device="cuda", generator=gen) * 4).to(dtype)  # 2050: a partial second block
    t[0, 0] = torch.finfo(dtype).max  # overflows to inf in both
    for g in (torch.rand(4096, 1, device="cuda", generator=gen) * 8,
              torch.tensor(0.37, device="cuda").expand(4096).unsqueeze(-1)):  # a row stride of 0 (loss.sum())
        want = (t * g).to(dtype)
        before = t.clone()
        assert torch.equal(kce.row_scaled(t, g), want) and torch.equal(t, before)
        assert torch.equal(kce.row_scaled(t, g, inplace=True), want) and torch.equal(t, want)
        t = before


def _loss_and_grads(x, w, t, g, weighted):
    from paratron.parallel.tensor import linear_cross_entropy
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy(x, w, t)
    if weighted:
        (loss * g).sum().backward()
    else:  # the incoming gradient: ones expanded from a scalar (a row stride of 0)
        loss.sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "sum"])
def test_linear_cross_entropy_llama_1b_size(monkeypatch, weighted):
    from paratron.parallel import cross_entropy as ce
    from paratron.kernels import cross_entropy as kce
    gen = torch.Generator(device="cuda").manual_seed(2)
    n, h, v = 4096, 2048, 32768
    x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g = torch.rand(n, device="cuda", generator=gen) if weighted else torch.ones(n, device="cuda")
    calls = []
    fused = ce.fused_ce_
    monkeypatch.setattr(ce, "fused_ce_", lambda *a, **k: calls.append(1) or fused(*a, **k))
    loss, gx, gw = _loss_and_grads(x, w, t, g, weighted)
    assert calls == [1] and loss.dtype == torch.float32 and gx.dtype == gw.dtype == torch.bfloat16

    # fp32 reference: bf16 logits and gradient buffer cost ~2^-9 relative per element
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    ref = F.cross_entropy(xr @ wr.t(), t, reduction="none")
    (ref * g).sum().backward()
    assert (loss - ref).abs().max().item() < 0.05 and (loss - ref).abs().mean().item() < 5e-3
    assert _rel(gx, xr.grad) < 1e-2 and _rel(gw, wr.grad) < 1e-2

    # backward: exactly the expressions it replaced, on the buffer the forward kept
    d = torch.mm(x, w.t())
    kce.fused_ce_(d, t)
    gcol = g.unsqueeze(-1)
    assert torch.equal(gx, (d @ w * gcol).to(x.dtype))
    assert torch.equal(gw, ((x * gcol).to(x.dtype).t() @ d).t())

    # the two-pass code (compiled statistics, then the compiled overwrite)
    monkeypatch.setattr(ce, "_fusable", lambda *a: False)
    loss2, gx2, gw2 = _loss_and_grads(x, w, t, g, weighted)
    assert (loss - loss2).abs().max().item() <= 2e-5
    assert _rel(gx, gx2) < 1e-3 and _rel(gw, gw2) < 1e-3


def test_logits_cross_entropy_bert_size(monkeypatch):
    """BERT's loss (an output layer with a bias, so logits first): the one Triton pass over the bf16 logits against
    F.cross_entropy over their fp32 copy (what the path replaced), losses and the gradients of the layer's input,
    weight and bias; the logits' gradient exactly ``(softmax - onehot rounded) * g`` rounded."""
    from paratron.parallel import cross_entropy as ce
    from paratron.kernels import cross_entropy as kce
    gen = torch.Generator(device="cuda").manual_seed(3)
    s, b, h, v = 512, 4, 1024, 30522
    x = torch.randn(s, b, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    bias = (torch.randn(v, device="cuda", generator=gen) * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, v, (s, b), device="cuda", generator=gen)
    g = torch.rand(s, b, device="cuda", generator=gen)
    calls = []
    fused = ce.fused_ce_
    monkeypatch.setattr(ce, "fused_ce_", lambda *a, **k: calls.append(1) or fused(*a, **k))

    def run(fn):
        x.grad = w.grad = bias.grad = None
        logits = F.linear(x, w, bias)
        loss = fn(logits, t)
        (loss * g).sum().backward()
        return loss.detach(), x.grad, w.grad, bias.grad

    mine = run(ce.logits_cross_entropy)
    assert calls == [1]
    eager = run(ce.vocab_parallel_cross_entropy)
    assert calls == [1]
    assert (mine[0] - eager[0]).abs().max().item() <= 2e-5
    for a, e in zip(mine[1:], eager[1:]):
        assert a.dtype == torch.bfloat16 and _rel(a, e) < 1e-2

    # the gradient the linear receives: the kernel's buffer times g, rounded once more
    seen = []
    logits = F.linear(x.detach(), w.detach(), bias.detach()).requires_grad_()
    logits.register_hook(lambda gr: seen.append(gr.clone()))
    (ce.logits_cross_entropy(logits, t) * g).sum().backward()
    d = F.linear(x.detach(), w.detach(), bias.detach())
    kce.fused_ce_(d.view(-1, v), t.reshape(-1))
    assert torch.equal(seen[0], (d * g.unsqueeze(-1)).to(d.dtype))
