"""The mixture-of-experts layer on CUDA (skipped elsewhere): in fp32 it equals the naive token-by-token reference
and the same layer on the CPU, output and gradients, with the aux loss attached (the paths that differ on the
device: nonzero_static's routing order, index_add_, cuBLAS's per-expert GEMMs); in bf16 on Hopper the grouped
GEMM path equals the per-expert loop within bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from paratron.model import moe
from paratron.model.layers import Parallel
from tests.unit.test_moe import naive, small

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _grads(layer: moe.MoELayer, x: torch.Tensor, g: torch.Tensor, reference: bool = False):
    out = naive(layer, x, True) if reference else layer(x)
    return [out, *torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])]


def check_against_cpu_and_reference(tokens: int, device: str) -> None:
    """With the aux loss: ``device`` equals the CPU; without it: ``device`` equals the naive reference there."""
    torch.manual_seed(3)
    for balance in ("aux_loss", "none"):
        cfg = small(swiglu=True, moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type=balance)
        cpu = moe.MoELayer(cfg, Parallel()).train()
        here = moe.MoELayer(cfg, Parallel(), device=device).train()
        here.load_state_dict(cpu.state_dict())
        x = torch.randn(tokens, 2, 16)
        g = torch.randn(tokens, 2, 16)
        got = _grads(here, x.to(device).requires_grad_(), g.to(device))
        want = (_grads(cpu, x.clone().requires_grad_(), g) if balance == "aux_loss"
                else _grads(here, x.to(device).requires_grad_(), g.to(device), reference=True))
        assert len(got) == len(want) == 2 + len(list(cpu.parameters()))
        for a, b in zip(got, want):
            assert torch.allclose(a.cpu(), b.cpu(), atol=1e-5, rtol=1e-5), balance


@pytest.mark.parametrize("tokens", [16, 512])
def test_cuda_layer_equals_cpu_and_reference(tokens):
    check_against_cpu_and_reference(tokens, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                    or not hasattr(torch, "_grouped_mm"), reason="grouped GEMM needs Hopper or newer")
def test_cuda_grouped_gemm_equals_loop_in_bf16():
    torch.manual_seed(4)
    layers = [moe.MoELayer(small(swiglu=True, moe_grouped_gemm=grouped), Parallel(), device="cuda",
                           dtype=torch.bfloat16) for grouped in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(256, 2, 16, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    outs = [_grads(layer, x.clone().requires_grad_(), g) for layer in layers]
    assert [layer.experts.used_grouped_mm for layer in layers] == [False, True]
    for a, b in zip(*outs):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * b.float().abs().max().item(), err
