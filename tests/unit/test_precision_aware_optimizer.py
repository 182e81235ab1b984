"""Megatron's --use-precision-aware-optimizer (paratron/optim/moments.py): Adam's moments held in bf16, fp16
(scaled) or fp8 (scaled) and computed in fp32, and --main-grads-dtype bf16. The step against torch's AdamW and
against hand-computed values, training through the Trainer (plain, distributed and offloaded optimizer), the
state's bytes against the planner's, checkpoints across moment dtypes, the kernel's bf16 moments in Triton's
interpreter, and the refusals."""
from __future__ import annotations

import pytest
import torch

from paratron.checkpoint import sharded
from paratron.config import ConfigError, parse_args
from paratron.optim.moments import RANGE, LowPrecisionAdamW
from paratron.train.loop import Trainer
from tests.unit.test_train import TINY, losses_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FP32 = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
AWARE = ["--use-precision-aware-optimizer"]


def _groups(ps: list) -> list:
    return [{"params": [ps[0]], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]


def _pair(dtypes: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(40, 24, generator=g), torch.randn(17, generator=g)]
    mine = [t.clone() for t in init]
    return init, mine, LowPrecisionAdamW(_groups(mine), 1e-2, (0.9, 0.999), 1e-8, dtypes), g


def test_fp32_moments_step_exactly_as_torch_adamw():
    """The class's own step, with its moments held in fp32, is torch's single-tensor AdamW bit for bit."""
    init, mine, adam, g = _pair(FP32)
    ref = [t.clone() for t in init]
    torch_adam = torch.optim.AdamW(_groups(ref), lr=1e-2, foreach=False)
    for step in range(5):
        adam.param_groups[0]["lr"] = torch_adam.param_groups[0]["lr"] = 1e-2 / (step + 1)
        for p, q in zip(mine, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        adam.step()
        torch_adam.step()
    for p, q in zip(mine, ref):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(adam.state[p][k], torch_adam.state[q][k]), k


def test_bf16_moments_are_the_fp32_step_with_moments_rounded_between_steps():
    """bf16 moments: each step is the fp32 step from the rounded moments, its new moments rounded to nearest."""
    init, mine, adam, g = _pair({"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16})
    ref = [t.clone() for t in init]
    torch_adam = torch.optim.AdamW(_groups(ref), lr=1e-2, foreach=False)
    for _ in range(4):
        for p, q in zip(mine, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        adam.step()
        torch_adam.step()
        for q in ref:  # what bf16 storage means: the moments rounded after every step
            for k in ("exp_avg", "exp_avg_sq"):
                torch_adam.state[q][k].copy_(torch_adam.state[q][k].bfloat16())
    for p, q in zip(mine, ref):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq"):
            assert adam.state[p][k].dtype == torch.bfloat16
            assert torch.equal(adam.state[p][k].float(), torch_adam.state[q][k]), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_scaled_moments_by_hand(dtype):
    """One step from zero moments, beta1 0.9 and beta2 0.999, gradient [1, -2, 0.5, 0]: exp_avg = [0.1, -0.2, 0.05,
    0] held as [R/2, -R, R/4, 0] with scale 0.2 / R; exp_avg_sq = 1e-3 [1, 4, 0.25, 0] held as [R/4, R, R/16, 0]
    with scale 4e-3 / R (R: fp16 max / 2 or 448, all exact in both dtypes); a master whose gradient is zero keeps
    zero moments and a zero scale (no division by it)."""
    p, zero = torch.zeros(4), torch.zeros(3)
    adam = LowPrecisionAdamW([{"params": [p, zero], "weight_decay": 0.0}], 1e-3, (0.9, 0.999), 1e-8,
                             {"exp_avg": dtype, "exp_avg_sq": dtype})
    p.grad, zero.grad = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.zeros(3)
    adam.step()
    r, st = RANGE[dtype], adam.state[p]
    assert st["exp_avg"].dtype == dtype
    assert st["exp_avg"].float().tolist() == [r / 2, -r, r / 4, 0.0]
    assert st["exp_avg_sq"].float().tolist() == [r / 4, r, r / 16, 0.0]
    assert st["exp_avg_scale"].item() == pytest.approx(0.2 / r, rel=1e-6)
    assert st["exp_avg_sq_scale"].item() == pytest.approx(4e-3 / r, rel=1e-6)
    assert torch.allclose(adam.unscaled(p, "exp_avg"), torch.tensor([0.1, -0.2, 0.05, 0.0]), rtol=1e-6)
    # the update of step 1 is lr * sign(g) for nonzero g (m / sqrt(v) with both bias-corrected)
    assert torch.allclose(p, torch.tensor([-1e-3, 1e-3, -1e-3, 0.0]), atol=1e-9)
    z = adam.state[zero]
    assert z["exp_avg_scale"].item() == 0.0 and not z["exp_avg"].float().any() and torch.isfinite(zero).all()


def _trainer(*extra: str) -> Trainer:
    return Trainer(parse_args(TINY + ["--train-iters", "6", "--eval-iters", "0", *extra]))


def _moment_dtypes(t: Trainer) -> set:
    return {s[k].dtype for s in t.optimizer.adam.state.values() for k in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["plain", "distributed"])
def test_training_with_bf16_and_fp8_moments(optimizer):
    """bf16 model: bf16 / fp8 moments train as fp32 moments do (close losses), the state holds them in their
    dtypes and is 4 + 1 bytes an element smaller; --main-grads-dtype bf16 gives the bf16 gradient buffer."""
    ref = _trainer("--bf16", *optimizer)
    want = losses_of(ref, 4)
    low = _trainer("--bf16", *optimizer, *AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp8",
                   "--main-grads-dtype", "bf16")
    got = losses_of(low, 4)
    assert got[-1] < got[0] and max(abs(a - b) for a, b in zip(got, want)) < 0.02 * want[0], (got, want)
    assert _moment_dtypes(low) == {torch.bfloat16, torch.float8_e4m3fn} and _moment_dtypes(ref) == {torch.float32}
    assert low.cfg.parallel.grad_reduce_in_bf16 and not ref.cfg.parallel.grad_reduce_in_bf16
    assert {buf.grad_data.dtype for m in low.models for buf in m.grad_buffers} == {torch.bfloat16}
    elems = sum(m.numel() for m in low.optimizer.masters)
    scales = 4 * len(low.optimizer.masters)  # exp_avg_sq's fp32 scale per master
    assert ref.optimizer.state_bytes() - low.optimizer.state_bytes() == elems * (2 + 3) - scales


def test_offloaded_masters_step_as_on_the_device():
    """--optimizer-cpu-offload (which Megatron requires with the flag) with bf16 moments: the host's masters step
    with the same moments in the same dtypes, the same losses bit for bit."""
    flags = ["--bf16", *AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    want = losses_of(_trainer(*flags), 4)  # (one trainer at a time: each seeds the generators dropout draws from)
    off = _trainer(*flags, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.6")
    assert off.optimizer.host is not None and off.optimizer.host_state_bytes() > 0
    assert losses_of(off, 4) == want
    assert _moment_dtypes(off) == {torch.bfloat16}


def test_checkpoints_across_moment_dtypes(tmp_path):
    """fp8 moments are saved as their fp32 values and restored scaled: a resumed run continues exactly; the same
    checkpoint loads into a run with bf16 moments (rounded) and with fp32 ones (equal)."""
    flags = ["--bf16", "--use-distributed-optimizer"]
    fp8 = [*AWARE, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"]
    a = _trainer(*flags, *fp8, "--save", str(tmp_path))
    losses_of(a, 2)
    a.save()
    assert a.optimizer.adam._views == []  # the save's fp32 copies are not kept
    want = losses_of(a, 2)
    b = _trainer(*flags, *fp8, "--load", str(tmp_path))
    assert b.iteration == 2 and losses_of(b, 2) == want
    files = sharded.load_full(tmp_path / "iter_0000002")
    assert {t.dtype for k, t in files.items() if k.startswith("optimizer.exp_avg")} == {torch.float32}
    b = _trainer(*flags, *fp8, "--load", str(tmp_path))
    c = _trainer(*flags, *AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--load", str(tmp_path))
    d = _trainer(*flags, "--load", str(tmp_path))
    for x, y, z in zip(b.optimizer.masters, c.optimizer.masters, d.optimizer.masters):  # (the same layout)
        for k in ("exp_avg", "exp_avg_sq"):
            saved = d.optimizer.adam.state[z][k]  # fp32: the checkpoint's values
            assert saved.any() and torch.equal(c.optimizer.adam.state[y][k], saved.bfloat16()), k
            assert torch.allclose(b.optimizer.adam.unscaled(x, k), saved, rtol=1e-6, atol=0), k


@pytest.mark.parametrize("extra, message", [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
    ([*AWARE, "--main-params-dtype", "fp16"], "--main-params-dtype fp16 (master weights in fp16"),
    ([*AWARE, "--exp-avg-sq-dtype", "fp4"], "--exp-avg-sq-dtype fp4: choose one of fp32, bf16, fp16, fp8"),
    ([*AWARE, "--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --bf16"),
    ([*AWARE, "--bf16", "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"],
     "contradicts --accumulate-allreduce-grads-in-fp32"),
    ([*AWARE, "--optimizer", "muon", "--bf16"], "works with --optimizer adam only"),
])
def test_refusals(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_args(TINY + extra)


KERNEL = r"""
import torch
from paratron.kernels.fused_adamw import adamw_step_
from paratron.optim.moments import LowPrecisionAdamW
g = torch.Generator().manual_seed(0)
init = [torch.randn(3, 5000, generator=g), torch.randn(37, generator=g)]
bf16 = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
def make(device_steps):
    ps = [t.clone() for t in init]
    return ps, LowPrecisionAdamW([{"params": ps, "weight_decay": 0.1}], 1e-2, (0.9, 0.999), 1e-8, bf16, device_steps)
mine, kern = make(True)
ref, plain = make(False)
outs = {mine[0]: mine[0].bfloat16()}
for step in range(4):
    grads = [torch.randn(t.shape, generator=g) for t in init]
    for p, q, gr in zip(mine, ref, grads):
        p.grad, q.grad = gr.clone(), gr.clone()
        q.data.copy_(p)  # each step from the same masters and bf16 moments (the interpreter's cut moments differ
        for k in ("exp_avg", "exp_avg_sq"):  # from the rounded ones by a bf16 step, which later steps would carry)
            plain.state[q][k].copy_(kern.state[p][k])
    adamw_step_(kern, outs, None, torch.tensor(0.0))
    plain.step()
    for p, q in zip(mine, ref):
        assert ((p - q).norm() / q.norm()).item() <= 1e-6, step
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = kern.state[p][k], plain.state[q][k]
            assert a.dtype == b.dtype == torch.bfloat16
            # the interpreter cuts fp32 -> bf16 where CUDA rounds to nearest: one bf16 step apart at most
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7 + 1e-30).all(), (step, k)
    assert int(kern.state[mine[0]]["step"]) == step + 1
print("ok")
"""


def test_kernel_steps_bf16_moments_in_the_interpreter():
    """The AdamW kernel (kernels/fused_adamw.py) reads and writes bf16 moments: the same step as the class's."""
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(KERNEL)


def test_kernel_refuses_scaled_moments():
    from paratron.kernels import fused_adamw
    p = torch.zeros(8)
    adam = LowPrecisionAdamW([{"params": [p]}], 1e-3, (0.9, 0.999), 1e-8,
                             {"exp_avg": torch.float16, "exp_avg_sq": torch.float32})
    p.grad = torch.ones(8)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        fused_adamw._rows(p, p.grad, adam.state[p], None)
