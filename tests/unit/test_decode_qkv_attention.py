"""The QKV projection and the fused decode attention as one kernel (kernels/decode_qkv_attention.py): its reference
against the two steps it fuses, the kernel against the reference through Triton's CPU interpreter (with and without
the attention's norm, the projection's bias and --qk-layernorm, fp32 and bf16, the group counters left at zero), and
``--kernel-decode-attention fused_qkv`` through the engine: the unfused path's tokens, the fused op called at every
layer of every step."""
import dataclasses

import pytest
import torch

from paratron.config import KernelConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.sampling import SamplingParams
from paratron.kernels import decode_qkv_attention as fused
from paratron.kernels import decode_rotary, gemv_row
from paratron.model.gpt import GPTModel
from tests.interpret import interpret
from tests.unit.test_decode_rotary import rope
from tests.unit.test_generate import PROMPTS, VOCAB, tiny_model


def test_reference_is_the_row_gemv_then_the_fused_attention():
    torch.manual_seed(0)
    g, qpg, d, k, cap, slot = 2, 3, 16, 48, 40, 29
    x, w = torch.randn(k), torch.randn(g * (qpg + 2) * d, k) / 7
    norm, bias = 1 + 0.1 * torch.randn(k), torch.randn(g * (qpg + 2) * d)
    cos, sin = rope(d, 25)
    caches = torch.randn(2, 1, g, cap, d)
    k1, v1 = caches.clone()
    k2, v2 = caches.clone()
    pad, at = torch.tensor([4]), torch.tensor(slot)
    got = fused.reference(x, w, norm, 1e-5, bias, cos, sin, k1, v1, pad, at, 0.3, g)
    qkv = gemv_row.row_reference(x[None], w, norm, eps=1e-5, bias=bias).view(g, qpg + 2, d)
    want = decode_rotary.decode_rotary_reference(qkv, cos, sin, k2, v2, pad, at, 0.3)
    assert torch.equal(got, want) and torch.equal(k1, k2) and torch.equal(v1, v2)


KERNEL = r"""
import torch
from paratron.kernels.decode_qkv_attention import reference
torch.manual_seed(0)
for g, qpg, d, k, cap, slot, pad, dtype, tol in ((2, 4, 16, 96, 150, 137, 0, torch.float32, 1e-5),
                                                 (1, 1, 64, 64, 70, 5, 2, torch.float32, 1e-5),
                                                 (4, 2, 32, 128, 200, 190, 3, torch.bfloat16, 2e-2)):
    n = g * (qpg + 2) * d
    x = torch.randn(k, dtype=dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = (slot - pad) * torch.cat([inv, inv])
    cos, sin = angles.cos(), angles.sin()
    weights = (1 + 0.2 * torch.randn(2, k)).to(dtype)
    heads = (1 + 0.2 * torch.randn(2, d)).to(dtype)  # the query and key heads' RMSNorm weights (--qk-layernorm)
    for norm, bias, norms in ((None, None, None), (weights[0], torch.randn(n, dtype=dtype), None),
                              (weights[1], None, (heads[0], heads[1], 1e-6))):
        kc, vc = torch.randn(2, 1, g, cap, d, dtype=dtype)
        kc[:, :, slot + 1:], vc[:, :, slot + 1:] = float("nan"), float("nan")  # past the slot: never read
        kc[:, :, :pad], vc[:, :, :pad] = float("nan"), float("nan")  # padding: never read
        rk, rv = kc.nan_to_num(), vc.nan_to_num()
        want = reference(x, w, norm, 1e-5, bias, cos, sin, rk, rv, torch.tensor([pad]), torch.tensor(slot), 0.125, g,
                         norms)
        counts = torch.zeros(g + 1, dtype=torch.int32)
        e = torch.zeros(0, dtype=dtype)
        got = torch.ops.paratron.decode_qkv_attention(
            x[None], w, e if norm is None else norm, 1e-5, e if bias is None else bias, cos, sin, kc, vc,
            torch.tensor([pad]), torch.tensor(slot), 0.125, counts, g, False,
            *(norms or (e, e, 0.0)))
        assert not counts.any(), counts  # each group's last program set its counter back
        assert got.shape == want.shape == (1, g, qpg, d) and got.dtype == dtype and torch.isfinite(got).all()
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, (g, qpg, d, dtype, norm is not None, bias is not None, norms is not None, err)
        # the key and value written at the slot: the projection's sums run in another order than the reference's
        # matmul, so in bf16 within two ulps of values below 4
        close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -5)
        assert torch.allclose(kc[0, :, slot].float(), rk[0, :, slot].float(), **close)
        assert torch.allclose(vc[0, :, slot].float(), rv[0, :, slot].float(), **close)
        assert kc[:, :, slot + 1:].isnan().all() and kc[:, :, :pad].isnan().all()
        assert torch.equal(kc[:, :, pad:slot], rk[:, :, pad:slot])
        assert torch.equal(vc[:, :, pad:slot], rv[:, :, pad:slot])
print("ok")
"""


def test_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    interpret(KERNEL)


@pytest.mark.parametrize("extra", [(), ("--qk-layernorm",), ("--add-qkv-bias",)])
def test_a_batch_1_decode_step_takes_the_qkv_projection_inside_the_attention(monkeypatch, extra):
    """On CPU the op is its reference: ``--kernel-decode-attention fused_qkv`` gives the greedy tokens of the
    per-module path, with one fused QKV-attention call and three row GEMVs a layer (and the output layer's) a decode
    step; two rows keep the per-module path."""
    from paratron.model.attention import sdpa
    from tests.unit.test_gemv_row import _tiny, _tokens
    model, vocab = _tiny(extra, attention="fused_qkv")
    with torch.no_grad():  # (a bias that matters: the layers' start at zero)
        for layer in model.decoder.layers:
            if layer.self_attention.linear_qkv.bias is not None:
                layer.self_attention.linear_qkv.bias.normal_(0, 0.5)
    assert all(layer.decode_rows and layer.self_attention.fused_qkv for layer in model.decoder.layers)
    fused_calls, calls = [], []
    real = sdpa.decode_qkv_attention.decode_qkv_attention
    monkeypatch.setattr(sdpa.decode_qkv_attention, "decode_qkv_attention",
                        lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    plain, rows = _tokens(model, vocab, 1, monkeypatch, calls)
    steps = 5  # decode steps after the prefill
    assert rows == plain and len(fused_calls) == steps * model.config.num_layers
    assert len(calls) == steps * (3 * model.config.num_layers + 1)
    fused_calls.clear()
    calls.clear()
    plain, rows = _tokens(model, vocab, 2, monkeypatch, calls)
    assert rows == plain and not calls and not fused_calls


def test_applies_to_short_caches_and_whole_groups_only(monkeypatch):
    """Where the row GEMV applies (CUDA: monkeypatched here), the kernel takes caches of at most FUSED_SPAN slots
    (one program walks a group's) of the fused attention's shapes; longer caches run the two kernels."""
    monkeypatch.setattr(fused.decode_rotary, "triton", True)  # (the shapes' check, as where Triton is installed)
    monkeypatch.setattr(gemv_row, "applies", lambda x, w: True)
    x, w = torch.empty(2048, dtype=torch.bfloat16), torch.empty(8 * 6 * 64, 2048, dtype=torch.bfloat16)
    cache = torch.empty(1, 8, decode_rotary.FUSED_SPAN, 64, dtype=torch.bfloat16)
    longer = torch.empty(1, 8, decode_rotary.FUSED_SPAN + 1, 64, dtype=torch.bfloat16)
    assert fused.applies(x, w, cache, cache, 8) and not fused.applies(x, w, longer, longer, 8)
    assert not fused.applies(x, w, cache.float(), cache.float(), 8)  # (the cache in another dtype)
    assert not fused.applies(x, w[:-64], cache, cache, 8)  # (rows that are not whole groups)
