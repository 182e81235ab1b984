"""Diagnose the memory-efficient kernel's backward with a document mask and merged LSE (CUDA only).

    python benchmarks/ring_efficient_diag.py

Prints the relative error of dq/dk/dv against fp32 SDPA for several ways of calling the kernel's
backward (one block or two key halves merged; expanded or materialised bias; padded LSE layouts)."""
import torch
import torch.nn.functional as F

from paratron.parallel.context import document_causal_mask
from paratron.parallel.ring import EFFICIENT, _additive_mask, _expand, _fold, _merge


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    torch.manual_seed(0)
    b, h, g, s, d = 2, 8, 2, 512, 64
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    for name, docs in (("one-doc", torch.zeros(2, s)), ("three-docs", torch.cat([torch.zeros(2, 100), torch.ones(2, 100), torch.full((2, s - 200), 2.0)], 1))):
        docs = docs.long().cuda()
        same = docs[:, :, None] == docs[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
        qr, kr, vr = (t.float().clone().requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=document_causal_mask(docs), enable_gqa=True)
        want.backward(dout.float())
        # (a) one block, whole keys, its own out/lse
        o, l, aux = EFFICIENT.forward(q, k, v, False, same & causal, scale)
        gr = EFFICIENT.backward(dout, q, k, v, o.to(q.dtype), l, False, same & causal, scale, aux)
        print(name, "one block: out", round(rel(o, want), 4), "dq", round(rel(gr[0], qr.grad), 4),
              "dk", round(rel(gr[1], kr.grad), 4), "dv", round(rel(gr[2], vr.grad), 4))
        # (a2) one block, layouts: out / dout / q,k,v made contiguous or transposed-contiguous
        bias = _additive_mask(False, same & causal, q, s, align=16).expand(-1, h, -1, -1)
        padded = F.pad(l, (0, -(-s // 32) * 32 - s)).contiguous()

        def tc(t):
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        print(name, "out strides", tuple(o.stride()), "dout strides", tuple(dout.stride()))
        for label, fo, fd, fq in (("as is", lambda t: t, lambda t: t, lambda t: t),
                                  ("out contiguous", lambda t: t.contiguous(), lambda t: t, lambda t: t),
                                  ("out+dout transposed", tc, tc, lambda t: t),
                                  ("all transposed", tc, tc, tc)):
            dq0, dk0, dv0, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                fd(dout), fq(q), fq(_expand(k, h)), fq(_expand(v, h)), bias, fo(o.to(q.dtype)), padded, aux[0], aux[1],
                0.0, [True, True, True, False], False, scale=scale)
            print(name, "one block", label, "dq", round(rel(dq0, qr.grad), 4), "dk", round(rel(_fold(dk0, g), kr.grad), 4),
                  "dv", round(rel(_fold(dv0, g), vr.grad), 4))
        # (a3) torch's own SDPA autograd with the efficient backend and the same float mask
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q2, k2, v2 = (t.clone().requires_grad_() for t in (q, _expand(k, h), _expand(v, h)))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            y = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=bias[:, :, :, :s], scale=scale)
        y.backward(dout)
        print(name, "torch sdpa efficient autograd: out", round(rel(y, want), 4), "dq", round(rel(q2.grad, qr.grad), 4),
              "dk", round(rel(_fold(k2.grad, g), kr.grad), 4))
        # (b) two key halves, merged
        half = s // 2
        parts = [EFFICIENT.forward(q, k[:, :, sl], v[:, :, sl], False, (same & causal)[:, :, sl], scale)
                 for sl in (slice(0, half), slice(half, None))]
        out, lse = parts[0][0].float(), parts[0][1].clone()
        _merge(out, lse, parts[0][0], parts[0][1], first=True)
        _merge(out, lse, parts[1][0], parts[1][1], first=False)
        final = out.to(q.dtype)
        for label, kw in (("expanded bias", {}),):
            grads = [EFFICIENT.backward(dout, q, k[:, :, sl], v[:, :, sl], final, lse, False, (same & causal)[:, :, sl],
                                        scale, parts[i][2]) for i, sl in enumerate((slice(0, half), slice(half, None)))]
            print(name, "two halves", label, "out", round(rel(out, want), 4),
                  "dq", round(rel(grads[0][0].float() + grads[1][0].float(), qr.grad), 4),
                  "dq half0", round(rel(grads[0][0], qr.grad), 4),
                  "dk", round(rel(torch.cat([grads[0][1], grads[1][1]], 2), kr.grad), 4))
        # (c) direct aten call, bias materialised per head, own lse layouts
        for mat in (False, True):
            sl = slice(0, half)
            bias = _additive_mask(False, (same & causal)[:, :, sl], q, half, align=16)
            bias = bias.expand(-1, h, -1, -1)
            if mat:
                bias = bias.contiguous()
            padded = F.pad(lse, (0, -(-s // 32) * 32 - s)).contiguous()
            dq0, dk0, dv0, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, _expand(k[:, :, sl], h), _expand(v[:, :, sl], h), bias, final, padded, parts[0][2][0],
                parts[0][2][1], 0.0, [True, True, True, False], False, scale=scale)
            # reference for half 0 only: P from final lse
            sc = (q.float() @ _expand(k[:, :, sl], h).float().transpose(-1, -2)) * scale
            sc = sc.masked_fill(~(same & causal)[:, None, :, sl], float("-inf"))
            p = torch.exp(sc - lse[..., None])
            dp = dout.float() @ _expand(v[:, :, sl], h).float().transpose(-1, -2)
            dsum = (dout.float() * final.float()).sum(-1, keepdim=True)
            ds = p * (dp - dsum)
            dq_ref = ds @ _expand(k[:, :, sl], h).float() * scale
            print(name, "direct half0 materialised" if mat else "direct half0 expanded", "dq vs manual", round(rel(dq0, dq_ref), 4))


if __name__ == "__main__":
    main()
