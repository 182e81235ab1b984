"""The Triton kernels of paratron/model/kernels.py against the torch expressions they replace,
run through Triton's CPU interpreter (the same kernels run on CUDA in tests/gpu)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r"""
import torch
from paratron.model.kernels import swiglu_reference
torch.manual_seed(0)
# odd sizes: a column block that is partly masked, more than one block per row, leading dims
for shape, dtype, tol in (((5, 3, 2 * 1500), torch.float32, 1e-6), ((7, 2 * 64), torch.bfloat16, 1e-2),
                          ((0, 2 * 8), torch.float32, 0.0)):
    h = torch.randn(*shape, dtype=dtype, requires_grad=True)
    g = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
    out = torch.ops.paratron.swiglu(h)
    out.backward(g)
    ref_h = h.detach().double().requires_grad_()
    ref = swiglu_reference(ref_h)
    ref.backward(g.double())
    assert out.shape == ref.shape and out.dtype == dtype and h.grad.dtype == dtype
    for got, want in ((out, ref), (h.grad, ref_h.grad)):
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= tol, (shape, dtype, err)
print("ok")
"""


def test_swiglu_kernel_matches_torch_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
