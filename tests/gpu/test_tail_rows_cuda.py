"""kernels/tail_rows.py's kernel on a GPU against its torch reference: the rows from the device-held start on are
zero, the rows before it untouched, for starts at 0, inside, at the end and past a wide tail."""
import pytest
import torch

from paratron.kernels import tail_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or tail_rows.triton is None,
                                                  reason="needs CUDA and Triton")]


@pytest.mark.parametrize("start", [0, 1, 4095, 33792, 34816])
@pytest.mark.parametrize("n", [1024, 7168, 100])
def test_zero_from_equals_the_reference(start, n):
    torch.manual_seed(0)
    out = torch.randn(34816, n, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([128, start], device="cuda", dtype=torch.int32)
    want = tail_rows.zero_from_reference(out.clone(), starts)
    got = tail_rows.zero_from(out, starts)
    assert got is out and torch.equal(got, want)
