"""The QKV projection and the fused decode attention as one kernel (kernels/decode_qkv_attention.py) on the GPU: at
llama-1b's shapes in bf16 against its torch reference (the attention's norm, the projection's bias, --qk-layernorm,
launched early or not, the group counters left at zero, the caches written at the slot only), replayed from a CUDA
graph with new slots, and ``--kernel-decode-attention fused_qkv`` through the compiled decode step against
``fused`` (the two-kernel path)."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels.decode_qkv_attention import applies, decode_qkv_attention, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(g=8, qpg=4, d=64, k=2048, cap=384):
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(g * (qpg + 2) * d, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    norm = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    bias = torch.randn(g * (qpg + 2) * d, device="cuda", generator=gen).bfloat16()
    heads = (1 + 0.2 * torch.randn(2, d, device="cuda", generator=gen)).bfloat16()
    caches = torch.randn(2, 1, g, cap, d, device="cuda", generator=gen).bfloat16()
    angles = 300.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    return x, w, norm, bias, (heads[0], heads[1], 1e-6), caches, torch.cat([angles, angles])


def test_kernel_matches_the_reference():
    x, w, norm, bias, qk, caches, angles = _inputs()
    cos, sin = angles.cos(), angles.sin()
    counts = torch.zeros(8, dtype=torch.int32, device="cuda")
    assert applies(x, w, caches[0], caches[1], 8)
    for slot, pad in ((300, 0), (383, 7), (2, 0)):
        for nw, b, norms in ((norm, None, None), (norm, bias, None), (None, None, qk)):
            for pdl in (False, True):
                k, v = caches.clone()
                rk, rv = caches.clone()
                at, first = torch.tensor(slot, device="cuda"), torch.tensor([pad], device="cuda")
                got = decode_qkv_attention(x, w, nw, 1e-5, b, cos, sin, k, v, first, at, 0.125, counts, 8, pdl, norms)
                want = reference(x, w, nw, 1e-5, b, cos, sin, rk, rv, first, at, 0.125, 8, norms)
                assert _rel(got, want) < 1e-2, (slot, pad, pdl)
                assert not counts.any()
                # the key and value at the slot: the GEMV's sums in another order than cuBLAS's (an ulp or two)
                assert torch.allclose(k[0, :, slot].float(), rk[0, :, slot].float(), rtol=2 ** -6, atol=2 ** -5)
                assert torch.allclose(v[0, :, slot].float(), rv[0, :, slot].float(), rtol=2 ** -6, atol=2 ** -5)
                k[0, :, slot], v[0, :, slot] = rk[0, :, slot], rv[0, :, slot]
                assert torch.equal(k, rk) and torch.equal(v, rv)  # nothing else written


def test_kernel_replays_from_a_cuda_graph_with_new_slots():
    x, w, norm, _, _, caches, angles = _inputs()
    cos, sin = angles.cos(), angles.sin()
    counts = torch.zeros(8, dtype=torch.int32, device="cuda")
    k, v = caches.clone()
    at, first = torch.tensor(100, device="cuda"), torch.tensor([3], device="cuda")
    decode_qkv_attention(x, w, norm, 1e-5, None, cos, sin, k, v, first, at, 0.125, counts, 8, True)  # (warm-up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_qkv_attention(x, w, norm, 1e-5, None, cos, sin, k, v, first, at, 0.125, counts, 8, True)
    for slot in (150, 151, 383):
        at.fill_(slot)
        rk, rv = k.clone(), v.clone()
        graph.replay()
        want = reference(x, w, norm, 1e-5, None, cos, sin, rk, rv, first, at, 0.125, 8)
        assert _rel(out, want) < 1e-2 and not counts.any(), slot


def test_engine_with_the_qkv_in_the_attention_gives_the_fused_paths_tokens_through_cuda_graphs():
    """--kernel-decode-attention fused_qkv at batch 1 (compiled decode step, CUDA graph, the row GEMVs) against
    fused: the same greedy tokens over a short generation and log-probabilities within bf16's rounding."""
    from paratron.config import KernelConfig, ModelConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    from paratron.model.gpt import GPTModel
    m = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, group_query_attention=True,
                    num_query_groups=2, seq_length=256, max_position_embeddings=256, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3).resolved()
    torch.manual_seed(0)
    models = [GPTModel(m, 512, device="cuda", dtype=torch.bfloat16,
                       kernels=KernelConfig(kernel_decode_attention=a)).eval() for a in ("fused", "fused_qkv")]
    models[1].load_state_dict(models[0].state_dict())
    reqs = [Request(list(range(3, 40)), SamplingParams(24, logprobs=True))]
    want, got = (Engine(model, 500, compile=True).generate(reqs)[0] for model in models)
    assert got.tokens[:16] == want.tokens[:16]
    assert (torch.tensor(got.logprobs[:16]) - torch.tensor(want.logprobs[:16])).abs().max() < 0.05
