"""FlashAttention-4 on Hopper (skipped elsewhere or without flash-attn-4): the custom ops against SDPA on
sequence-first strided views (value and gradients, eager and compiled, grouped and plain heads, head
dims 64 and 128), and a llama-shaped attention layer taking the path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratron.kernels import flash_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or flash_attention._fa_fwd is None
    or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU and flash-attn-4")


def _inputs(s, b, heads, groups, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, heads, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s, b, groups, 2, d, device="cuda", generator=g).bfloat16()
    dy = torch.randn(s, b, heads * d, device="cuda", generator=g).bfloat16()
    return q, kv, dy


def _run(fn, q, kv, dy, dtype):
    q, kv = (t.to(dtype).requires_grad_() for t in (q, kv))
    y = fn(q, kv[:, :, :, 0], kv[:, :, :, 1])
    return [y.float(), *(g.float() for g in torch.autograd.grad(y, (q, kv), dy.to(dtype)))]


def _sdpa(q, k, v):
    s, b, h, d = q.shape
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=q.size(2) != k.size(2))
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


@pytest.mark.parametrize("shape", [(1000, 2, 8, 2, 64), (512, 2, 4, 4, 128), (2048, 1, 32, 8, 64)])
@pytest.mark.parametrize("compiled", [False, True])
def test_op_matches_sdpa(shape, compiled):
    """Errors against an fp32 SDPA no more than twice (plus a floor) those of bf16 SDPA."""
    q, kv, dy = _inputs(*shape)
    fa = flash_attention.causal_attention
    fn = torch.compile(fa, fullgraph=True) if compiled else fa
    got = _run(fn, q, kv, dy, torch.bfloat16)
    ref = _run(_sdpa, q, kv, dy, torch.float32)
    bf16 = _run(_sdpa, q, kv, dy, torch.bfloat16)
    assert got[0].shape == ref[0].shape
    for name, a, r, b in zip(("out", "dq", "dkv"), got, ref, bf16):
        err, base = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * base + 1e-3, f"{name}: {err} vs bf16 SDPA's {base}"


def test_llama_shaped_layer_takes_flash_attention(monkeypatch):
    from paratron.config import parse_args
    from paratron.model.attention import build_core
    from paratron.model.layers import Attention, ForwardContext, Parallel
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "512", "--num-attention-heads", "8",
                      "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
                      "--attention-dropout", "0", "--mock-data", "--train-iters", "1", "--lr", "1e-3",
                      "--micro-batch-size", "2"]).model
    attn = Attention(cfg, Parallel(), device="cuda", dtype=torch.bfloat16)
    assert attn.flash
    calls = []
    real = flash_attention._fwd
    monkeypatch.setattr(flash_attention, "_fwd", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(256, 2, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = attn(x, ForwardContext())
    y.float().square().sum().backward()
    assert calls and torch.isfinite(x.grad).all()
    attn.core_attention = build_core(cfg, Parallel(), device="cuda", dtype=torch.bfloat16, flash=False)
    x2 = x.detach().clone().requires_grad_()
    y2 = attn(x2, ForwardContext())
    assert ((y.float() - y2.float()).norm() / y2.float().norm()).item() < 2e-2

