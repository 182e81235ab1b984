"""The decode-attention Triton kernel on the GPU: against the torch expression in bf16 at llama-1b's
decode shapes, and replayed from a captured CUDA graph with the slot and padding changed in memory
between replays (as the decode step's graph does)."""
from __future__ import annotations

import pytest
import torch

from paratron.kernels.decode_attention import decode_attention, decode_attention_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(b=32, g=8, qpg=4, d=64, cap=512):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, g, qpg, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(b, g, cap, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(b, g, cap, d, device="cuda", generator=gen).bfloat16()
    pad = torch.randint(0, 100, (b,), device="cuda")
    return q, k, v, pad


def test_kernel_matches_the_torch_expression():
    q, k, v, pad = _inputs()
    for slot in (100, 300, 511):
        s = torch.tensor(slot, device="cuda")
        assert _rel(decode_attention(q, k, v, pad, s, 0.125), decode_attention_reference(q, k, v, pad, s, 0.125)) < 1e-2


def test_kernel_replays_from_a_cuda_graph_with_new_slots():
    q, k, v, pad = _inputs(b=4)
    slot = torch.tensor(150, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, pad, slot, 0.125)  # compile the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, pad, slot, 0.125)
    for new_slot, new_pad in ((150, 0), (400, 7), (511, 120)):
        slot.fill_(new_slot)
        pad.fill_(new_pad)
        graph.replay()
        want = decode_attention_reference(q, k, v, pad, slot, 0.125)
        assert _rel(out, want) < 1e-2, (new_slot, new_pad)


def test_fused_rotary_decode_kernel_matches_the_reference_and_writes_the_rotated_key_bit_for_bit():
    """kernels/decode_rotary.py at llama-1b's grouping in bf16, one program per group and split contexts: the
    output against the torch reference, the cache written as the model's apply_rotary rounds (the same bits)."""
    from paratron.kernels.decode_rotary import decode_rotary_attention, decode_rotary_reference
    gen = torch.Generator(device="cuda").manual_seed(1)
    g, qpg, d, cap = 8, 4, 64, 2048
    qkv = torch.randn(g, qpg + 2, d, device="cuda", generator=gen).bfloat16()
    angles = 300.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
    counts = torch.zeros(g, dtype=torch.int32, device="cuda")  # the splits combined in the kernel (the KV cache's)
    for slot, pad, splits, count in ((300, 0, 1, None), (300, 7, 4, None), (1500, 3, 0, None), (2, 0, 8, None),
                                     (300, 7, 4, counts), (1500, 3, 0, counts), (2, 0, 8, counts),
                                     (1900, 0, 0, counts)):
        k, v = (torch.randn(1, g, cap, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        rk, rv = k.clone(), v.clone()
        at, first = torch.tensor(slot, device="cuda"), torch.tensor([pad], device="cuda")
        for pdl in (False, True, False):  # again: the counts were left at zero; launched for PDL once
            got = decode_rotary_attention(qkv, cos, sin, k, v, first, at, 0.125, splits, count, pdl)
        want = decode_rotary_reference(qkv, cos, sin, rk, rv, first, at, 0.125)
        assert _rel(got, want) < 1e-2, (slot, pad, splits, count is None)
        assert torch.equal(k, rk) and torch.equal(v, rv), (slot, pad, splits)
        assert not counts.any()
        # Qwen3-style query / key norms before the rotation (--qk-layernorm): the reference's output and cache write
        norms = (1 + 0.2 * torch.randn(2, d, device="cuda", generator=gen)).bfloat16()
        norms = (norms[0], norms[1], 1e-6)
        k.copy_(rk), v.copy_(rv)
        normed = decode_rotary_attention(qkv, cos, sin, k, v, first, at, 0.125, splits, count, True, norms=norms)
        nk, nv = rk.clone(), rv.clone()
        want = decode_rotary_reference(qkv, cos, sin, nk, nv, first, at, 0.125, norms)
        assert _rel(normed, want) < 1e-2 and torch.equal(v, nv), (slot, pad, splits)
        assert (k.float() - nk.float()).abs().max() <= 2 ** -6 * nk.float().abs().max(), (slot, pad, splits)


def test_engine_with_the_fused_rotary_decode_gives_the_unfused_tokens_through_cuda_graphs():
    """--kernel-decode-attention fused at batch 1 (compiled decode step, CUDA graph) against the unfused path."""
    from paratron.config import KernelConfig, ModelConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    from paratron.model.gpt import GPTModel
    m = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, group_query_attention=True,
                    num_query_groups=2, seq_length=512, max_position_embeddings=512, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3).resolved()
    torch.manual_seed(0)
    plain = GPTModel(m, 512, device="cuda", dtype=torch.bfloat16,  # (auto takes the fused path on CUDA)
                     kernels=KernelConfig(kernel_decode_attention="triton")).eval()
    fused = GPTModel(m, 512, device="cuda", dtype=torch.bfloat16,
                     kernels=KernelConfig(kernel_decode_attention="fused")).eval()
    fused.load_state_dict(plain.state_dict())
    reqs = [Request(list(range(3, 40)), SamplingParams(64, logprobs=True))]
    want = Engine(plain, 500, compile=True).generate(reqs)[0]
    engine = Engine(fused, 500, compile=True)
    got = engine.generate(reqs)[0]
    # The fused kernel sums the context in its own order: in bf16 the log-probabilities differ by rounding, and a
    # greedy near-tie may go the other way after many tokens. The yardstick is a third attention path (torch's
    # SDPA) against the default one: the fused path may differ from the default by about as much, over the tokens
    # all three share. A wrong rotation or cache write differs within the first tokens, by far more.
    sdpa = GPTModel(m, 512, device="cuda", dtype=torch.bfloat16,
                    kernels=KernelConfig(kernel_decode_attention="sdpa")).eval()
    sdpa.load_state_dict(plain.state_dict())
    other = Engine(sdpa, 500, compile=True).generate(reqs)[0]

    def agree(a, b):
        return next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(b.tokens))

    same = min(agree(got, want), agree(other, want))
    assert agree(got, want) >= 16, (got.tokens, want.tokens)
    noise = (torch.tensor(other.logprobs[:same]) - torch.tensor(want.logprobs[:same])).abs().max().item()
    off = (torch.tensor(got.logprobs[:same]) - torch.tensor(want.logprobs[:same])).abs().max().item()
    assert off <= 2 * noise + 1e-3, (off, noise, same)
    assert engine.graph is not None and engine.graph.graph is not None
    # --kernel-decode-pdl on: Inductor's kernels and the fused attention launched early, waiting for their inputs
    # (the tuning may pick other block shapes: held to the same yardstick)
    early = GPTModel(m, 512, device="cuda", dtype=torch.bfloat16,
                     kernels=KernelConfig(kernel_decode_attention="fused", kernel_decode_pdl="on")).eval()
    early.load_state_dict(plain.state_dict())
    pdl = Engine(early, 500, compile=True).generate(reqs)[0]
    same = min(agree(pdl, want), same)
    assert agree(pdl, want) >= 16, (pdl.tokens, want.tokens)
    off = (torch.tensor(pdl.logprobs[:same]) - torch.tensor(want.logprobs[:same])).abs().max().item()
    assert off <= 2 * noise + 1e-3, (off, noise, same)
