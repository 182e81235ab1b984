"""The MoE layer compiled whole on a GPU (issue 46): Inductor traces a dropless grouped-GEMM MoE layer in one graph
(fullgraph: a break raises), its step synchronises nothing with the host, and it gives eager's output and
gradients to bf16 precision."""
from __future__ import annotations

import pytest
import torch

from paratron.model import moe
from paratron.model.layers import Parallel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_compiled_moe_layer_is_one_graph_never_synchronises_and_equals_eager():
    from tests.unit.test_moe_dispatch import _cfg
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's compiled form needs sm90")
    torch.manual_seed(5)
    layer = moe.MoELayer(_cfg(moe_shared_expert_intermediate_size=16), Parallel(), device="cuda",
                         dtype=torch.bfloat16).train()
    x = torch.randn(64, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = layer(x)
    want.float().square().sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(2):  # compilation and lazy initialisation outside the checked step
        compiled(x).float().square().sum().backward()
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = compiled(x)
        got.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _rel(got, want) < 2e-2 and _rel(x.grad, want_grad) < 2e-2
