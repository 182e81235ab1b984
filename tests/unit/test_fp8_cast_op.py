"""paratron::cast_fp8 on CPU (its torch expression; the Triton kernel is checked against it in
tests/gpu/test_cuda_paths.py) and its use for the FP8 linears' output gradients: the same results as
the torch ops it replaces (--kernel-fp8-grad-cast off)."""
import dataclasses

import pytest
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


# The cast kernels under Triton's CPU interpreter, at one tile config (the interpreter has no benchmarker for the
# autotuner): each program's atomic max lands on the tensor's amax bit for bit, and the cast pass computes the scale
# compute_scale gives for it (margins, e5m2, zero and subnormal amaxes, a preset); the FP8 values themselves are
# checked on the GPU (tests/gpu/test_cuda_paths.py: the interpreter rounds some values to FP8 its own way).
INTERPRET = r"""
import torch
from paratron.kernels import fp8_cast as fc
torch.manual_seed(0)


class Fixed:  # an autotuned kernel at one tile config
    def __init__(self, tuned, config):
        self.fn, self.config, self.best_config = tuned.fn, config, config

    def __getitem__(self, grid):
        return lambda *args, **kw: self.fn[grid](*args, **kw, **self.config.kwargs)


for name in ("_act_amax", "_act_cast", "_grad_amax", "_grad_cast"):
    tuned = getattr(fc, name)
    setattr(fc, name, Fixed(tuned, tuned.configs[TILE_INDEX]))
fc.FAST_RCP = False  # (the interpreter runs no inline PTX: GeLU's reciprocal by division)
E4M3, E5M2 = fc.E4M3, fc.E5M2
zero = torch.tensor(0.0)

def check_scale(scale, current, dtype, margin):
    want = fc.compute_scale(current, fc.FMAX[dtype], margin)
    assert torch.equal(scale, want), (scale.item(), want.item())

# a plain cast (IDENTITY): the amax is x's, bit for bit, and the scale is compute_scale's
for dtype, margin, shape in ((E4M3, 0, (96, 200)), (E5M2, 1, (70, 130)), (E4M3, 3, (33, 64))):
    x = torch.randn(*shape).to(torch.bfloat16) * 30
    q, qt, scale, current = fc._forward_cast(x, None, zero, fc.IDENTITY, dtype, margin, False)
    assert torch.equal(current, x.float().abs().amax()), (current, x.float().abs().amax())
    check_scale(scale, current, dtype, margin)
    rq = fc._to_fp8(x.float(), zero, dtype, margin)[0]  # (the interpreter rounds some values to FP8 its own way)
    assert (q.float() == rq.float()).float().mean().item() > 0.9
    assert torch.equal(qt.float(), q.float().t())
    # a preset scale is kept; the amax of what was cast still comes back
    q, qt, scale, current = fc._forward_cast(x, None, torch.tensor(2.5), fc.IDENTITY, dtype, margin, True)
    assert scale.item() == 2.5 and torch.equal(current, x.float().abs().amax())
# zeros and a subnormal amax: scale 1 (compute_scale's guard: amax 0, quotient overflowing)
for v in (0.0, 1e-45):
    x = torch.full((64, 64), v)
    _, _, scale, current = fc._forward_cast(x, None, zero, fc.IDENTITY, E4M3, 0, False)
    assert scale.item() == 1.0 and torch.equal(fc.compute_scale(current, 448.0), scale), (v, scale)
# the activations and their gradients: the scale is compute_scale of the amax both passes find
for act in (fc.SWIGLU, fc.GELU, fc.GELU_TANH):
    cols = 2 * 96 if act == fc.SWIGLU else 96
    h = torch.randn(80, cols).to(torch.bfloat16)
    d = torch.randn(80, 96).to(torch.bfloat16)
    q, qt, scale, current = fc._forward_cast(h, None, zero, act, E4M3, 0, False)
    ref = fc.act_fp8_reference(h, None, zero, act, 0)
    check_scale(scale, current, E4M3, 0)
    assert abs(current.item() / ref[3].item() - 1) < 1e-5, (act, current, ref[3])
    q, qt, scale, current, db = fc._backward_cast(h, None, d, zero, act, E5M2, 0, False)
    ref = fc.grad_fp8_reference(h, None, d, zero, act, True, 0)
    check_scale(scale, current, E5M2, 0)
    assert abs(current.item() / ref[3].item() - 1) < 1e-5, (act, current, ref[3])
print("ok")
"""


@pytest.mark.parametrize("tile", [0, 3])
def test_cast_kernels_find_the_amax_and_its_scale_in_the_interpreter(tile):
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(INTERPRET.replace("TILE_INDEX", str(tile)))
