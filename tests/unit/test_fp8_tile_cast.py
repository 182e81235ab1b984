"""The blockwise recipe's tile cast of an operand in both layouts (kernels/fp8_tile_cast.py) against its torch
reference: through Triton's CPU interpreter the kernel's scales and its scaled values before the FP8 conversion (an
fp32 output buffer keeps them) equal the reference's bit for bit, with partial tiles, an all-zero tile and a margin;
the kernel compiles for Hopper; the switch picks it only where asked and refuses it without a GPU; the blockwise
linear and experts take both layouts from one call."""
import dataclasses

import pytest
import torch

CHECK = r"""
import torch
from paratron.kernels.fp8_block import _scaled
from paratron.kernels.fp8_cast import E4M3, FMAX
from paratron.kernels.fp8_tile_cast import TILE, _ceil, _tile_cast_both, reference

torch.manual_seed(0)
fmax = FMAX[E4M3]
for m, k, margin, dt in ((200, 300, 0, torch.float32), (256, 128, 1, torch.bfloat16), (130, 520, 0, torch.bfloat16)):
    x = (torch.randn(m, k) * torch.rand(m, 1) * 5).to(dt)
    x[:128, 128:256] = 0  # an all-zero tile: scale 1
    x[5, 7] = 3e4
    q, qt = torch.empty(m, k), torch.empty(k, m)  # fp32 outputs: the scaled, saturated values before the cast
    s, st = torch.empty(m, _ceil(k)), torch.empty(k, _ceil(m))
    _tile_cast_both[(_ceil(m), _ceil(k))](x, q, s, qt, st, m, k, _ceil(k), _ceil(m), 2.0 ** margin, FMAX_=fmax, T=TILE)
    _, ws, _, wst = reference(x, margin)
    assert torch.equal(s, ws) and torch.equal(st, wst), (m, k, (s - ws).abs().max(), (st - wst).abs().max())
    assert torch.equal(q, _scaled(x, ws, 1, divide=False).clamp(-fmax, fmax))
    assert torch.equal(qt, _scaled(x.t(), wst, 1, divide=False).clamp(-fmax, fmax))
    if k >= 256:  # the zero tile, seen from both sides
        assert (ws[:128, 1] == 1).all() and (wst[128:256, 0] == 1).all()
print("ok")
"""


def test_tile_cast_scales_and_values_equal_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(CHECK)


def test_tile_cast_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from tests.unit.test_triton_sm90 import sm90_cubin
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32",
             "MULT": "fp32"}
    assert len(sm90_cubin("fp8_tile_cast", "_tile_cast_both", types, {"FMAX_": 448.0, "T": 128})) > 0


def test_switch_takes_the_kernel_on_a_gpu_only_and_refuses_it_without_one():
    from paratron.config.kernels import CHOICES, KernelConfig
    from paratron.errors import ConfigError
    from paratron.fp8 import Recipe
    from paratron.kernels import switches
    from paratron.train.resolve import parse_args
    assert CHOICES["kernel_fp8_block_cast"] == ("auto", "triton", "torch")
    assert switches.resolve(KernelConfig(), "cpu", torch.bfloat16).kernel_fp8_block_cast == "torch"
    gpu = switches.offer_of_kind(hopper_bf16=True)
    assert switches.resolve(KernelConfig(), "cpu", torch.bfloat16, offered=gpu).kernel_fp8_block_cast == "triton"
    with pytest.raises(ConfigError, match="--kernel-fp8-block-cast triton"):
        switches.resolve(dataclasses.replace(KernelConfig(), kernel_fp8_block_cast="triton"), "cpu", torch.bfloat16)
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--kernel-fp8-block-cast", "triton"])
    train = dataclasses.replace(cfg.train, fp8_format="e4m3", fp8_recipe="blockwise")
    assert Recipe.from_config(train, cfg.kernels).block_cast == "triton"
    assert Recipe.from_config(train, KernelConfig()).block_cast == "torch"


@pytest.mark.parametrize("where", ["linear", "experts"])
def test_blockwise_layers_take_both_layouts_from_the_switched_cast(where, monkeypatch):
    """With block_cast "triton" the blockwise linear and experts quantise each operand through one call of the
    paratron::fp8_tile_cast_both op (here its torch reference stands in for it, on the CPU) and give the numbers
    of the default path."""
    from paratron.fp8 import FP8State, Recipe
    from paratron.fp8.blockwise import block_linear
    from paratron.fp8.experts import fp8_grouped_mm
    from paratron.kernels import fp8_tile_cast
    calls = []

    def stand_in(x, margin):
        calls.append(tuple(x.shape))
        return fp8_tile_cast.reference(x, margin)
    monkeypatch.setattr(fp8_tile_cast, "_op", stand_in)
    torch.manual_seed(0)
    x0, w0 = torch.randn(256, 128), torch.randn(2, 128, 128) * 0.1
    ends, g = torch.tensor([128, 256], dtype=torch.int32), torch.randn(256, 128)
    out = {}
    for cast in ("torch", "triton"):
        state = FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True, block_cast=cast))
        x, w = x0.clone().requires_grad_(), (w0[0] if where == "linear" else w0).clone().requires_grad_()
        y = block_linear(x, w, state) if where == "linear" else fp8_grouped_mm(x, w, ends, state)
        y.backward(g)
        out[cast] = (y, x.grad, w.grad)
    assert calls == [(256, 128), (256, 128)]  # the input in the forward, the output gradient in the backward
    for a, b in zip(out["torch"], out["triton"]):
        assert torch.equal(a, b)
