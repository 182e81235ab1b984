"""The ring attention's GPU block kernel (flash attention's aten ops, paratron/parallel/ring.py) on one
GPU, skipped without CUDA: what the ring relies on, against SDPA's own attention in bf16.

- the causal diagonal block equals causal SDPA;
- two key halves, each attended with its LSE and merged, equal attention over all keys;
- each half's backward from the merged output and final LSE sums (dQ) and concatenates (dK, dV) to
  the gradients of attention over all keys (GQA: K/V heads repeated per block, folded back);
- with packed documents, the memory-efficient kernel (mask as a bias) does the same."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(b=2, h=8, g=2, s=256, d=64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, s, d, generator=gen).to("cuda", torch.bfloat16) for n in (h, g, g, h)]


def reference(q, k, v, dout, causal: bool):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def test_flash_block_kernel_is_the_gpu_choice_and_matches_causal_sdpa():
    from paratron.parallel.ring import FLASH, kernel_for
    q, k, v, dout = inputs()
    assert kernel_for(q, masked=False) is FLASH
    out, lse, aux = FLASH.forward(q, k, v, True, None, q.size(-1) ** -0.5)
    want = reference(q, k, v, dout, True)
    assert rel(out, want[0]) < 1e-2 and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv = FLASH.backward(dout, q, k, v, out, lse, True, None, q.size(-1) ** -0.5, aux)
    for got, ref in zip((dq, dk, dv), want[1:]):
        assert rel(got, ref) < 2e-2


def test_flash_blocks_merge_by_lse_and_backprop_from_the_final_lse():
    from paratron.parallel.ring import FLASH, _merge
    q, k, v, dout = inputs()
    scale, half = q.size(-1) ** -0.5, k.size(2) // 2
    parts = [FLASH.forward(q, k[:, :, sl], v[:, :, sl], False, None, scale) for sl in (slice(0, half), slice(half, None))]
    out, lse = parts[0][0].float(), parts[0][1].clone()
    _merge(out, lse, parts[0][0], parts[0][1], first=True)
    _merge(out, lse, parts[1][0], parts[1][1], first=False)
    want = reference(q, k, v, dout, False)
    assert rel(out, want[0]) < 1e-2
    final = out.to(q.dtype)
    grads = [FLASH.backward(dout, q, k[:, :, sl], v[:, :, sl], final, lse, False, None, scale, parts[i][2])
             for i, sl in enumerate((slice(0, half), slice(half, None)))]
    assert rel(grads[0][0].float() + grads[1][0].float(), want[1]) < 2e-2
    assert rel(torch.cat([grads[0][1], grads[1][1]], 2), want[2]) < 2e-2
    assert rel(torch.cat([grads[0][2], grads[1][2]], 2), want[3]) < 2e-2


def test_efficient_kernel_with_document_masks_merges_and_backprops():
    """Documents on GPU: the memory-efficient kernel with the block's mask as a bias; the second key
    half holds only a later document, so some query rows have no key there (output 0, LSE -inf)."""
    from paratron.parallel.context import document_causal_mask
    from paratron.parallel.ring import EFFICIENT, _merge, kernel_for
    q, k, v, dout = inputs()
    s, half, scale = q.size(2), k.size(2) // 2, q.size(-1) ** -0.5
    docs = torch.cat([torch.zeros(2, 100), torch.ones(2, 100), torch.full((2, s - 200), 2.0)], 1).long().cuda()
    assert kernel_for(q, masked=True) is EFFICIENT
    same = docs[:, :, None] == docs[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    parts = []
    for sl in (slice(0, half), slice(half, None)):
        allowed = (same & causal)[:, :, sl]
        parts.append(EFFICIENT.forward(q, k[:, :, sl], v[:, :, sl], False, allowed, scale))
    out, lse = parts[0][0].float(), parts[0][1].clone()
    _merge(out, lse, parts[0][0], parts[0][1], first=True)
    _merge(out, lse, parts[1][0], parts[1][1], first=False)
    qr, kr, vr = (t.float().clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=document_causal_mask(docs), enable_gqa=True)
    want.backward(dout.float())
    assert torch.isfinite(out).all() and rel(out, want) < 1e-2
    final = out.to(q.dtype)
    grads = [EFFICIENT.backward(dout, q, k[:, :, sl], v[:, :, sl], final, lse, False, (same & causal)[:, :, sl],
                                scale, parts[i][2]) for i, sl in enumerate((slice(0, half), slice(half, None)))]
    assert rel(grads[0][0].float() + grads[1][0].float(), qr.grad) < 2e-2
    assert rel(torch.cat([grads[0][1], grads[1][1]], 2), kr.grad) < 2e-2
    assert rel(torch.cat([grads[0][2], grads[1][2]], 2), vr.grad) < 2e-2
