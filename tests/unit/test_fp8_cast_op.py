"""paratron::cast_fp8 on CPU (its torch expression; the Triton kernel is checked against it in
tests/gpu/test_cuda_paths.py) and its use for the FP8 linears' output gradients: the same results as
the torch ops it replaces (PARATRON_FP8_GRAD_CAST=0)."""
import dataclasses

import torch

from paratron import fp8
from paratron.fp8 import E4M3, E5M2, FP8State, Recipe


def test_cast_op_scales_by_preset_or_own_amax():
    x = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -8.0]])
    q, qt, scale, current = torch.ops.paratron.cast_fp8(x, torch.tensor(0.0), False, 0)
    assert current.item() == 8.0 and scale.item() == 448.0 / 8.0  # own amax: 8 maps to e4m3's 448
    assert q.dtype == E4M3 and torch.equal(qt.float(), q.float().t())
    assert torch.equal(q.float() / scale, torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -8.0]]))
    q, _, scale, current = torch.ops.paratron.cast_fp8(x, torch.tensor(1.0), True, 0)  # preset: kept, values saturate
    assert scale.item() == 1.0 and current.item() == 8.0 and q.dtype == E5M2
    q, _, scale, _ = torch.ops.paratron.cast_fp8(x * 1e5, torch.tensor(1.0), True, 0)
    assert q.float().abs().max().item() == 57344.0  # saturated at e5m2's largest, not inf


def _grads(recipe: Recipe, steps: int = 3):
    torch.manual_seed(0)
    x = torch.randn(32, 48, requires_grad=True)
    w = (torch.randn(64, 48) * 0.1).requires_grad_()
    state = FP8State(recipe)
    out = []
    for step in range(steps):
        x.grad = w.grad = None
        fp8.fp8_linear(x * (1 + step), w, state).backward(torch.randn(32, 64) * (step + 1))
        out += [x.grad.clone(), w.grad.clone()]
        fp8.prime([state])
    return out, state.grad.history


def test_linear_backward_same_with_the_op_and_without():
    for kind in ("tensorwise", "delayed"):
        base = Recipe(recipe=kind, amax_history_len=4, amax_compute_algo="max", emulate=True)
        with_op, hist = _grads(base)
        without, hist2 = _grads(dataclasses.replace(base, grad_cast_op=False))
        for a, b in zip(with_op, without):
            assert torch.equal(a, b)
        assert (hist is None and hist2 is None) or torch.equal(hist, hist2)
