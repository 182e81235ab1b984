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
