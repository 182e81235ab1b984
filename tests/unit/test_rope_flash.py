"""The rotary embedding inside the FlashAttention-4 op (flash_attention.rotary_causal_attention,
model/rope_kernels.py) on CPU: the op against ``apply_rotary`` + ``causal_attention`` (values and the QKV
gradient, eager and compiled, the op one node of the graph), the attention layer taking it and when it does not,
and the two Triton kernels under Triton's CPU interpreter against the torch expressions (bit-exact in bf16). The
kernels with FlashAttention-4 on a GPU: tests/gpu/test_rope_flash_cuda.py."""
from __future__ import annotations

import pytest
import torch

from paratron.config import KernelConfig, ModelConfig
from paratron.kernels import flash_attention
from paratron.model.attention import build_core
from paratron.model.layers import Attention, ForwardContext, Parallel, Rotary, apply_rotary

S, B, HEADS, GROUPS, D = 8, 2, 4, 2, 16
QPG = HEADS // GROUPS


def _inputs(dtype, seed=0):
    """The QKV GEMM's output [s, b, groups * (qpg + 2) * d] as a leaf, cos / sin [s, 1, 1, d] (the model's
    Rotary with a small base, so that every position turns), the output's gradient."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, B, GROUPS * (QPG + 2) * D, generator=g, dtype=dtype).requires_grad_()
    cos, sin = Rotary(_cfg(rotary_base=2))(S, None)
    return qkv, cos, sin, torch.randn(S, B, HEADS * D, generator=g, dtype=dtype)


def _unfused(qkv, cos, sin, scale):
    """Today's path: the layer's slices, ``apply_rotary``, then ``causal_attention``."""
    v5 = qkv.view(S, B, GROUPS, QPG + 2, D)
    q = v5[:, :, :, :QPG].reshape(S, B, HEADS, D)
    return flash_attention.causal_attention(apply_rotary(q, cos, sin), apply_rotary(v5[:, :, :, -2], cos, sin),
                                            v5[:, :, :, -1], scale)


def _fused(qkv, cos, sin, scale):
    return flash_attention.rotary_causal_attention(qkv.view(S, B, GROUPS, QPG + 2, D), cos, sin, scale, QPG)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("compiled", [False, True])
def test_op_gives_apply_rotary_and_causal_attention(dtype, tol, compiled):
    qkv, cos, sin, dy = _inputs(dtype)
    fused = torch.compile(_fused, fullgraph=True) if compiled else _fused
    for scale in (None, 0.3):
        want = _unfused(qkv, cos, sin, scale)
        got = fused(qkv, cos, sin, scale)
        assert got.shape == want.shape == (S, B, HEADS * D) and got.is_contiguous() and got.dtype == dtype
        (want_grad,), (grad,) = (torch.autograd.grad(y, qkv, dy) for y in (want, got))
        assert (got - want).abs().max() <= tol
        assert (grad - want_grad).abs().max() <= tol


def test_op_is_one_node_of_each_compiled_graph():
    """Inductor sees the forward and the backward as two opaque ops: nothing of the rotation is left to it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def grab(gm, _):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm)

    qkv, cos, sin, dy = _inputs(torch.float32)
    fn = torch.compile(_fused, backend=aot_autograd(fw_compiler=grab, bw_compiler=grab), fullgraph=True)
    fn(qkv, cos, sin, None).backward(dy)
    fwd, bwd = graphs
    assert "paratron.flash_attn_rope_fwd.default" in fwd and "paratron.flash_attn_rope_bwd.default" in bwd
    assert not any(name.startswith(("aten.mul", "aten.cat", "aten.neg", "aten.add")) for name in fwd + bwd)


def _cfg(**kw) -> ModelConfig:
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=HEADS, num_query_groups=GROUPS,
              group_query_attention=True, seq_length=S, max_position_embeddings=S, position_embedding_type="rope",
              hidden_dropout=0.0, attention_dropout=0.0, **kw)
    return ModelConfig(**kw).resolved()


@pytest.mark.parametrize("recompute", [False, True])
def test_attention_layer_takes_the_op_and_gives_the_unfused_flash_path(monkeypatch, recompute):
    torch.manual_seed(0)
    cfg = _cfg(rotary_base=2)
    attn = Attention(cfg, Parallel(), dtype=torch.float64)
    attn.core_attention = build_core(cfg, Parallel(), flash=True)  # the flash path on its CPU reference
    attn.recompute_core = recompute
    rope = tuple(t.double() for t in Rotary(_cfg(rotary_base=2))(S, None))
    x = torch.randn(S, B, 64, dtype=torch.float64, requires_grad=True)
    calls = []
    real = flash_attention.rotary_causal_attention
    monkeypatch.setattr(flash_attention, "rotary_causal_attention", lambda *a: calls.append(1) or real(*a))
    results = []
    for fused in (False, True):
        attn.core_attention.fused_rope = fused
        attn.zero_grad()
        x.grad = None
        y = attn(x, ForwardContext(rope=rope))
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in attn.parameters()] + [x.grad.clone()])
    assert calls  # the fused run took the op (twice under recompute: forward and its recomputation)
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-10)


def test_op_only_for_the_plain_rotation_of_a_flash_layer(monkeypatch):
    rope = Rotary(_cfg())(S, None)
    ctx = ForwardContext(rope=rope)

    def applies(cfg, ctx=ctx, flash=True, par=Parallel()):
        """Whether a layer of ``cfg`` built with (``flash``) or without the flash core takes the op."""
        return build_core(cfg, par, flash=flash).fuses_rotary(ctx, S)

    assert applies(_cfg())
    assert not applies(_cfg(), flash=False)  # SDPA: rotated by Inductor as before
    assert not applies(_cfg(), ForwardContext())  # no rope
    positions = torch.arange(S).flip(0)[None].expand(B, S)
    assert not applies(_cfg(), ForwardContext(rope=Rotary(_cfg())(S, positions)))
    for kw in (dict(rotary_interleaved=True), dict(rotary_percent=0.5), dict(qk_layernorm=True),
               dict(attention_output_gate=True), dict(no_rope_freq="[1]")):
        cfg = _cfg(**kw)
        assert not applies(cfg, ForwardContext(rope=Rotary(cfg)(S, None))), kw
    assert not applies(_cfg(), par=Parallel(kernels=KernelConfig(no_rope_fusion=True)))  # --no-rope-fusion


KERNELS = r"""
import torch
from paratron.kernels import flash_attention, rotary as rk
from paratron.model.layers import apply_rotary
torch.manual_seed(0)
# grouped and plain heads, a head dim whose half is no power of two, bf16 / fp16 / fp32 activations, fp32 or bf16
# cos / sin, more tokens than one program's block (masked rows), strided cos / sin rows
for s, b, groups, qpg, d, dtype, cdtype in ((40, 3, 2, 2, 16, torch.bfloat16, torch.float32),
                                            (5, 3, 3, 1, 12, torch.bfloat16, torch.bfloat16),
                                            (9, 2, 2, 4, 64, torch.float16, torch.float32),
                                            (7, 2, 2, 3, 16, torch.float32, torch.float32)):
    exact = dtype != torch.float32
    qkv5 = (torch.randn(s, b, groups * (qpg + 2) * d) * 3).to(dtype).view(s, b, groups, qpg + 2, d)
    ang = torch.randn(s, d // 2) * 3
    cos, sin = (f(torch.cat([ang, ang], -1)).to(cdtype) for f in (torch.cos, torch.sin))
    cos, sin = torch.cat([cos, cos], -1)[:, :d], torch.cat([sin, sin], -1)[:, :d]  # row stride 2d
    assert rk.usable(qkv5, cos, sin)
    q, k = rk.rotate_qk(qkv5, cos, sin)
    qr, kr = rk.rotate_qk_ref(qkv5, cos, sin)
    assert q.is_contiguous() and k.is_contiguous() and q.shape == qr.shape and k.shape == kr.shape
    for got, want in ((q, qr), (k, kr)):
        assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5), (dtype, got - want)
    # the backward against autograd of apply_rotary: query slots from dq, the key slot in place, v untouched
    dq = torch.randn(s, b, groups * qpg, d).to(dtype)
    dqkv = torch.randn(s, b, groups, qpg + 2, d).to(dtype)
    got = dqkv.clone()
    rk.unrotate_into_(got, dq, cos, sin)
    x = qkv5.clone().requires_grad_()
    c4, s4 = cos[:, None, None], sin[:, None, None]
    rotated = (apply_rotary(x[:, :, :, :qpg].reshape(q.shape), c4, s4), apply_rotary(x[:, :, :, qpg], c4, s4))
    want, = torch.autograd.grad(rotated, x, (dq, dqkv[:, :, :, qpg]))
    ok = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    assert ok(got[:, :, :, :-1], want[:, :, :, :-1]), (dtype, (got - want)[:, :, :, :-1].abs().max())
    assert torch.equal(got[:, :, :, -1], dqkv[:, :, :, -1])
    ref = dqkv.clone()
    rk.unrotate_into_ref_(ref, dq, cos, sin)
    assert ok(got, ref)
    # dq read in place from the packed backward's buffer, [b, groups, s, q_per_group, d] storage
    packed = dq.view(s, b, groups, qpg, d).permute(1, 2, 0, 3, 4).contiguous()
    for fn in (rk.unrotate_into_, rk.unrotate_into_ref_):
        got5 = dqkv.clone()
        fn(got5, packed.permute(2, 0, 1, 3, 4), cos, sin)
        assert torch.equal(got5, got if fn is rk.unrotate_into_ else ref), fn
# the whole op on the kernels (the attention on its CPU reference) against apply_rotary + causal_attention
qkv = torch.randn(12, 2, 2 * 4 * 16, dtype=torch.float32, requires_grad=True)
cos, sin = (f(torch.randn(12, 1, 1, 8).repeat(1, 1, 1, 2)) for f in (torch.cos, torch.sin))
v5 = qkv.view(12, 2, 2, 4, 16)
want = flash_attention.causal_attention(apply_rotary(v5[:, :, :, :2].reshape(12, 2, 4, 16), cos, sin),
                                        apply_rotary(v5[:, :, :, 2], cos, sin), v5[:, :, :, 3])
got = flash_attention.rotary_causal_attention(v5, cos, sin, None, 2)
dy = torch.randn_like(got)
(gw,), (gg,) = (torch.autograd.grad(y, qkv, dy) for y in (want, got))
assert torch.allclose(got, want, atol=1e-6) and torch.allclose(gg, gw, atol=1e-5), (got - want, gg - gw)
print("ok")
"""


def test_kernels_match_torch_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(KERNELS)
