"""kernels/tail_rows.py: the rows from a device-held start row to the end are zeroed, the rows before it kept, by the
reference and (in Triton's CPU interpreter) by the kernel; the kernel compiles for Hopper."""
import pytest
import torch

from paratron.kernels.tail_rows import zero_from, zero_from_reference

CHECK = r"""
import torch
from paratron.kernels.tail_rows import _zero_from, zero_from_reference

torch.manual_seed(0)
for s, n, start, programs, block in ((300, 70, 129, 4, 32), (64, 1030, 0, 8, 1024), (50, 16, 50, 3, 16),
                                     (40, 48, 7, 256, 32)):
    out = torch.randn(s, n).to(torch.bfloat16)
    want = zero_from_reference(out.clone(), torch.tensor([3, start], dtype=torch.int32))
    _zero_from[(programs,)](out, torch.tensor([3, start], dtype=torch.int32), 1, s, n, out.stride(0), BLOCK=block,
                            STEP=programs)
    assert torch.equal(out, want), (s, n, start)
    assert out[start:].abs().max().item() == 0 if start < s else True
    assert start == 0 or out[:start].abs().min(dim=1).values.max().item() > 0
print("ok")
"""


def test_reference_zeroes_from_the_last_start_on():
    out = torch.arange(1, 13, dtype=torch.float32).view(6, 2)
    zero_from_reference(out, torch.tensor([1, 4]))
    assert out[:4].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]] and out[4:].abs().sum() == 0
    cpu = torch.ones(5, 3)
    assert zero_from(cpu, torch.tensor([2], dtype=torch.int32)) is cpu and cpu.sum() == 6  # (CPU: the reference)


def test_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(CHECK)


def test_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from tests.unit.test_triton_sm90 import sm90_cubin
    types = {"out_ptr": "*bf16", "start_ptr": "*i32"}
    assert len(sm90_cubin("tail_rows", "_zero_from", types, {"BLOCK": 1024, "STEP": 256})) > 0
