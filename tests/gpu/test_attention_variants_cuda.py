"""Sliding windows and attention sinks on CUDA (bf16, SDPA's GPU kernels) against the float64 CPU
path, forward and gradients; skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.model.core_attention import CoreAttention
from paratron.model.layers import ForwardContext, Parallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("window,softmax_type", [(None, "learnable"), ("127,0", "learnable"), ("127,0", "vanilla"),
                                                 (None, "off-by-one")])
def test_cuda_bf16_equals_cpu_float64(window, softmax_type):
    b, h, g, s, d = 2, 16, 4, 512, 64
    cfg = ModelConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, group_query_attention=True,
                      num_query_groups=g, seq_length=s, window_size=window, softmax_type=softmax_type).resolved()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, g, g))
    w = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    results = []
    for device, dtype in (("cpu", torch.float64), ("cuda", torch.bfloat16)):
        core = CoreAttention(cfg, Parallel(), 0, device=device, dtype=dtype)
        if core.softmax_offset is not None and softmax_type == "learnable":
            with torch.no_grad():
                core.softmax_offset.copy_(torch.linspace(-2, 2, h))
        ins = [t.to(device, dtype).detach().requires_grad_(True) for t in (q, k, v)]  # leaves on each device
        out = core(*ins, ForwardContext())
        (out.double() * w.to(device)).sum().backward()
        grads = [t.grad for t in ins] + ([core.softmax_offset.grad] if softmax_type == "learnable" else [])
        results.append([out] + grads)
    for ref, got in zip(*results):
        err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, err
