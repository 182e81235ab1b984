"""The rotary embedding inside the FlashAttention-4 op on Hopper (skipped elsewhere or without flash-attn-4):
the two Triton kernels bit-exact against ``apply_rotary`` and its autograd in bf16, the op against
``apply_rotary`` + ``causal_attention`` at llama-1b's head shape (the same output bit for bit, gradients within
bf16 SDPA's error of an fp32 reference), and a compiled llama-shaped attention layer taking it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratron.kernels import flash_attention, rotary as rope_kernels
from paratron.model.layers import apply_rotary

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or flash_attention._fa_fwd is None
    or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU and flash-attn-4")

HEADS, GROUPS, D = 32, 8, 64  # llama-1b
QPG = HEADS // GROUPS


def _inputs(s, b, cos_dtype=torch.float32, seed=0, groups=GROUPS, qpg=QPG):
    """The QKV GEMM's output [s, b, groups * (qpg + 2) * d] (bf16, a leaf), cos / sin [s, 1, 1, d] as the
    model's Rotary makes them, the output's gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(s, b, groups * (qpg + 2) * D, device="cuda", generator=g).bfloat16().requires_grad_()
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    freqs = torch.outer(torch.arange(s, device="cuda").float(), inv)
    emb = torch.cat([freqs, freqs], -1)[:, None, None, :]
    dy = torch.randn(s, b, groups * qpg * D, device="cuda", generator=g).bfloat16()
    return qkv, emb.cos().to(cos_dtype), emb.sin().to(cos_dtype), dy


def _view(qkv, groups=GROUPS):
    return qkv.view(qkv.size(0), qkv.size(1), groups, -1, D)


def _unfused(qkv, cos, sin, groups=GROUPS):
    v5 = _view(qkv, groups)
    q = v5[:, :, :, :-2].flatten(2, 3)
    return flash_attention.causal_attention(apply_rotary(q, cos, sin), apply_rotary(v5[:, :, :, -2], cos, sin),
                                            v5[:, :, :, -1])


def _fused(qkv, cos, sin, groups=GROUPS):
    v5 = _view(qkv, groups)
    return flash_attention.rotary_causal_attention(v5, cos, sin, None, v5.size(3) - 2)


@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.bfloat16])
def test_kernels_are_bit_exact_against_apply_rotary_and_its_autograd(cos_dtype):
    qkv, cos, sin, _ = _inputs(2048, 2, cos_dtype)
    x = _view(qkv.detach()).clone().requires_grad_()
    c2, s2 = cos.view(2048, D), sin.view(2048, D)
    assert rope_kernels.usable(x, c2, s2)
    q, k = rope_kernels.rotate_qk(x.detach(), c2, s2)
    want_q = apply_rotary(x[:, :, :, :QPG].reshape(2048, 2, HEADS, D), cos, sin)
    want_k = apply_rotary(x[:, :, :, QPG], cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    g = torch.Generator(device="cuda").manual_seed(1)
    dq, dk = torch.randn(want_q.shape, device="cuda", generator=g).bfloat16(), torch.randn(
        want_k.shape, device="cuda", generator=g).bfloat16()
    want, = torch.autograd.grad((want_q, want_k), x, (dq, dk))
    dqkv = torch.full_like(x, float("nan"))
    dqkv[:, :, :, QPG] = dk
    dqkv[:, :, :, -1] = 7.0
    rope_kernels.unrotate_into_(dqkv, dq, c2, s2)
    assert torch.equal(dqkv[:, :, :, :-1], want[:, :, :, :-1]) and (dqkv[:, :, :, -1] == 7.0).all()


def _sdpa_fp32(qkv, cos, sin, groups):
    """The same attention in fp32 through SDPA: the reference of the gradients."""
    v5 = _view(qkv.float(), groups)
    q = apply_rotary(v5[:, :, :, :-2].flatten(2, 3), cos.float(), sin.float())
    k, v = apply_rotary(v5[:, :, :, -2], cos.float(), sin.float()), v5[:, :, :, -1]
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=True)
    return out.permute(2, 0, 1, 3).flatten(2)


@pytest.mark.parametrize("s,b,groups,qpg", [(2048, 2, 8, 4), (1000, 3, 8, 4), (512, 2, 4, 1)])
@pytest.mark.parametrize("compiled", [False, True])
def test_op_matches_the_unfused_path(s, b, groups, qpg, compiled):
    """The output bit for bit as apply_rotary + FlashAttention-4 eagerly (the same kernels on the same q, k, v);
    the QKV gradient (FlashAttention-4 accumulates dq, dk, dv with atomics) no further from an fp32 SDPA
    reference than twice the unfused path's error, plus a floor. Grouped heads (dK / dV from the postprocess
    kernel into their strided slots) and plain heads (written by the backward kernel itself)."""
    qkv, cos, sin, dy = _inputs(s, b, groups=groups, qpg=qpg)
    fused = torch.compile(_fused, fullgraph=True) if compiled else _fused
    got = fused(qkv, cos, sin, groups)
    want = _unfused(qkv, cos, sin, groups)  # eager: Inductor would round the rotation once, not as apply_rotary
    assert got.shape == (s, b, groups * qpg * D) and got.is_contiguous() and torch.equal(got, want)
    (grad,), (want_grad,) = (torch.autograd.grad(y, qkv, dy) for y in (got, want))
    ref_grad, = torch.autograd.grad(_sdpa_fp32(qkv, cos, sin, groups), qkv, dy.float())
    err, base = (grad.float() - ref_grad).abs().max().item(), (want_grad.float() - ref_grad).abs().max().item()
    assert err <= 2 * base + 1e-3, f"QKV gradient: {err} vs the unfused path's {base}"
    assert torch.isfinite(grad).all()


def test_compiled_llama_shaped_layer_takes_the_op(monkeypatch):
    from torch._inductor.compile_fx import compile_fx
    from paratron.config import parse_args
    from paratron.model.layers import Attention, ForwardContext, Parallel, Rotary
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "512", "--num-attention-heads", "8",
                      "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
                      "--position-embedding-type", "rope", "--attention-dropout", "0", "--mock-data",
                      "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "2"]).model
    attn = Attention(cfg, Parallel(), device="cuda", dtype=torch.bfloat16)
    rope = tuple(t.cuda() for t in Rotary(cfg)(256, None))
    assert attn.flash and attn.core_attention.fuses_rotary(ForwardContext(rope=rope), 256)
    x = torch.randn(256, 2, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 2, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(attn.core_attention, "fused_rope", fused)
        ops = []

        def backend(gm, example_inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        layer = torch.compile(attn, backend=backend, fullgraph=True)
        attn.zero_grad()
        x.grad = None
        y = layer(x, ForwardContext(rope=rope))
        y.backward(dy)
        assert any("flash_attn_rope_fwd" in op for op in ops) == fused
        results.append([y.float()] + [p.grad.float() for p in attn.parameters()] + [x.grad.float()])
    for a, b in zip(*results):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
