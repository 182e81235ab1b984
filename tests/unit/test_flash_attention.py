"""FlashAttention-4's wrapping (paratron/model/flash_attention.py) on CPU: the torch references of its
forward (output and log-sum-exp) and backward against SDPA, the custom ops' autograd on sequence-first
strided views (eager and compiled), and the attention layer's plumbing when it takes the path. The
kernels themselves: tests/gpu/test_flash_attention_cuda.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from paratron.config import parse_args
from paratron.kernels import flash_attention
from paratron.model.attention import build_core
from paratron.model.layers import Attention, ForwardContext, Parallel


def _qkv(s=12, b=2, heads=4, groups=2, d=8, dtype=torch.float64, seed=0):
    """Sequence-first q [s, b, heads, d] and k / v [s, b, groups, d], k and v slices of one tensor (as the
    layer's fused QKV output), all requiring grad through a leaf."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g, dtype=dtype).requires_grad_()
    kv = torch.randn(s, b, groups, 2, d, generator=g, dtype=dtype).requires_grad_()
    return q, kv, kv[:, :, :, 0], kv[:, :, :, 1]


def _sdpa(q, k, v, scale):
    """The same attention through SDPA ([b, heads, s, d], grouped heads) back to [s, b, heads * d]."""
    s, b, h, d = q.shape
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def test_references_match_sdpa_forward_lse_and_backward():
    q, _, k, v = _qkv()
    scale = 1 / math.sqrt(8)
    bq, bk, bv = (t.detach().transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
    out, lse = flash_attention.attention_ref(bq, bk, bv, scale)
    want = _sdpa(q.detach(), k.detach(), v.detach(), scale)
    assert torch.allclose(out.reshape(want.shape[1], want.shape[0], -1).transpose(0, 1), want, atol=1e-12)
    scores = torch.einsum("bqhd,bkhd->bhqk", bq, bk.repeat_interleave(2, dim=2)) * scale
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)
    assert lse.shape == (2, 4, 12)
    dout = torch.randn_like(bq)
    got = flash_attention.attention_bwd_ref(dout, bq, bk, bv, out, lse, scale)
    leaves = [t.clone().requires_grad_() for t in (bq, bk, bv)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True, scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    want = torch.autograd.grad(ref, leaves, dout)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("compiled", [False, True])
def test_op_on_sequence_first_views_gives_sdpa_values_and_gradients(compiled):
    q, kv, k, v = _qkv()
    dy = torch.randn(12, 2, 32, dtype=torch.float64)
    want = _sdpa(q, k, v, 0.3)
    want_grads = torch.autograd.grad(want, (q, kv), dy)
    fn = torch.compile(flash_attention.causal_attention, fullgraph=True) if compiled else flash_attention.causal_attention
    got = fn(q, k, v, 0.3)
    assert got.shape == (12, 2, 32) and got.is_contiguous()  # the output projection reads it in place
    assert torch.allclose(got, want, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (q, kv), dy), want_grads):
        assert torch.allclose(a, b, atol=1e-10)


def _cfg(*flags):
    return parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--num-query-groups", "2", "--group-query-attention", "--seq-length", "16",
                       "--mock-data", "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "2",
                       "--attention-dropout", "0", "--device", "cpu", *flags]).model


@pytest.mark.parametrize("recompute", [False, True])
def test_attention_layer_on_the_flash_path_gives_the_sdpa_path(recompute):
    """The layer's plumbing (no permutes, the sequence-first output) with the op on its CPU reference:
    same output and gradients as the SDPA path, also under --recompute-activations' core recompute."""
    torch.manual_seed(0)
    cfg = _cfg()
    attn = Attention(cfg, Parallel(), dtype=torch.float64)
    attn.recompute_core = recompute
    assert attn.training and attn.core_attention.dropout == 0.0
    x = torch.randn(16, 2, 32, dtype=torch.float64, requires_grad=True)
    results = []
    for flash in (False, True):
        attn.core_attention = build_core(cfg, Parallel(), flash=flash)  # the flash core on the op's CPU reference
        assert attn.flash == flash
        attn.zero_grad()
        x.grad = None
        y = attn(x, ForwardContext())
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in attn.parameters()] + [x.grad.clone()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-10)


def test_flash_path_only_for_plain_causal_attention_with_autograd():
    attn = Attention(_cfg(), Parallel())
    assert not attn.flash  # CPU: SDPA
    assert not flash_attention.wanted(64, "cpu", torch.bfloat16)
    assert not flash_attention.wanted(64, torch.device("cuda", 0), torch.float32)
    core = build_core(_cfg(), Parallel(), flash=True)  # the flash core, forced on the CPU
    assert core.applies(ForwardContext())
    assert not core.applies(ForwardContext(mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), causal=False))
    assert not core.applies(ForwardContext(causal=False))
    with torch.no_grad():  # generation and evaluation: SDPA
        assert not core.applies(ForwardContext())
    torch.use_deterministic_algorithms(True)
    try:  # --deterministic-mode: SDPA (FlashAttention-4's backward accumulates with atomics)
        assert not core.applies(ForwardContext())
    finally:
        torch.use_deterministic_algorithms(False)
    core.dropout = 0.1
    assert not core.applies(ForwardContext())
    core.eval()
    assert core.applies(ForwardContext())


def test_start_up_line_names_the_hopper_kernels_the_model_takes():
    from paratron.model.gpt import GPTModel
    from paratron.train.step import hopper_kernels
    cfg = _cfg("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear")
    model = GPTModel(cfg, 128)
    assert hopper_kernels([model]).startswith("none (pip install 'paratron[hopper]'")
    model.decoder.layers[0].self_attention.core_attention = build_core(model.config, model.par, flash=True)
    model.decoder.final_layernorm.quack = True
    assert hopper_kernels([model]) == "FlashAttention-4 attention, quack RMSNorm"


def _cudnn_returning(make_out):
    """A stand-in for cuDNN's op: (out from ``make_out(q)``, lse [b, h, s, 1]) for q [b, h, s, d]."""
    def op(q, k, v, *args, **kwargs):
        return make_out(q), torch.zeros(*q.shape[:3], 1)
    return op


def test_cudnn_forward_is_taken_only_with_a_sequence_first_output_and_falls_back_on_errors(monkeypatch):
    """``_cudnn_fwd`` (the CUDA forward's choice, run here on CPU tensors with the op stood in): cuDNN's
    output [b, h, s, d] is used when it views sequence-first storage, with lse [b, h, s]; an output in another
    layout, or an op that raises (a shape this cuDNN lacks: a warning), leaves the forward to FlashAttention-4."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    s, b, h, d = 16, 2, 4, 8
    q = torch.randn(s, b, h, d).transpose(0, 1)  # [b, s, h, d] views of sequence-first storage
    k = v = torch.randn(s, b, 2, d).transpose(0, 1)
    seq_first = _cudnn_returning(lambda q: torch.ones(s, b, h, d).permute(1, 2, 0, 3))  # [b, h, s, d] view
    monkeypatch.setattr(flash_attention, "_cudnn_op", seq_first)
    out, lse = flash_attention._cudnn_fwd(q, k, v, 0.5)
    assert out.shape == (b, s, h, d) and out.transpose(0, 1).is_contiguous() and lse.shape == (b, h, s)
    monkeypatch.setattr(flash_attention, "_cudnn_op", _cudnn_returning(lambda q: torch.ones(b, h, s, d)))
    assert flash_attention._cudnn_fwd(q, k, v, 0.5) is None  # batch-first output: not what the layer reads

    def unsupported(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: no engine for this graph\nmore")
    monkeypatch.setattr(flash_attention, "_cudnn_op", unsupported)
    with pytest.warns(UserWarning, match="cuDNN attention forward unavailable here"):
        assert flash_attention._cudnn_fwd(q, k, v, 0.5) is None
    monkeypatch.setattr(flash_attention, "_cudnn_op", seq_first)
    calls = []
    monkeypatch.setattr(flash_attention, "_cudnn_fwd", lambda *a: calls.append(1))
    flash_attention._fwd(q, k, v, 0.5, False)  # --attention-backend flash: FlashAttention-4's forward
    assert flash_attention._cudnn_fwd(q, k, v, 0.5) is None and calls == [1]  # (only the direct call)
