"""The optimizer step of a small bf16 / fp16 model on CUDA with the AdamW kernel of
paratron/kernels/fused_adamw.py (--kernel-fused-adamw auto, the default) against torch's fused AdamW and
the publishing copy (=0), plain and distributed optimizer: the same masters, Adam moments, step counters
and applied/skipped steps over a few steps with clipping, a scheduled learning rate, a separate
embedding learning rate and an overflowing step; the model weights the kernel wrote are its masters
rounded to nearest."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLAGS = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4", "--ffn-hidden-size", "200",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--lr", "1e-3", "--train-iters", "4",
         "--eval-iters", "0", "--clip-grad", "1.0", "--weight-decay", "0.1", "--decoupled-lr", "3e-3", "--device", "cuda"]
PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--loss-scale", "1024"]}  # fp16: a constant scale (no host sync)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(monkeypatch, fused: bool, flags: list[str]):
    """Four optimizer steps on the same gradients (the third overflows): (parameters, optimizer, applied)."""
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    t = Trainer(parse_args(flags + ([] if fused else ["--kernel-fused-adamw", "off"])))
    opt = t.optimizer
    assert (opt._fused_outs is not None) == fused
    params = [p for m in t.models for p in m.params]
    g = torch.Generator().manual_seed(1)  # the same gradients in both runs: drawn on the CPU
    applied = []
    for i in range(4):
        opt.set_lr(1e-3 * (4 - i), decoupled_lr=3e-3 / (i + 1))
        for p in params:
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.1 * opt.loss_scale)
        if i == 2:
            params[0].main_grad.view(-1)[5] = float("nan")
        ok, norm = opt.step()
        for m in t.models:
            m.finish_param_sync()
        applied.append(bool(ok))
    return params, opt, applied


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fused_adamw_step_matches_torch_fused_adamw_and_the_copy(monkeypatch, precision, distributed):
    flags = FLAGS + PRECISIONS[precision] + (["--use-distributed-optimizer"] if distributed else [])
    params, opt, applied = _run(monkeypatch, True, flags)
    _, ref, ref_applied = _run(monkeypatch, False, flags)
    assert applied == ref_applied == [True, True, False, True], (applied, ref_applied)
    assert len(opt.adam.param_groups) >= 2 and len({g["lr"] for g in opt.adam.param_groups}) >= 2
    for m, n in zip(opt.masters, ref.masters):
        # element by element within 1e-7 (a ten-thousandth of a step at these learning rates; seen on an H100:
        # 2e-8, 1.2e-7 at 1.0): torch's fused kernel computes 1 - beta^t in fp32, ~1e-5 of the update at small t
        assert torch.allclose(m, n, rtol=2 ** -22, atol=1e-7), (tuple(m.shape), (m - n).abs().max())
        s, r = opt.adam.state[m], ref.adam.state[n]
        assert s["step"].item() == r["step"].item() == 3
        # torch's fused kernel also takes 1 - beta2 in fp32 (1 - fp32(0.999), 1.3e-5 off the 0.001 of its
        # foreach AdamW and ours): its exp_avg_sq differs by that much, the update hardly (the same factor
        # is in its bias correction)
        for k, tol in (("exp_avg", 1e-6), ("exp_avg_sq", 3e-5)):
            assert _rel(s[k], r[k]) <= tol, (k, tuple(m.shape), _rel(s[k], r[k]))
    assert all(p.dtype == params[0].dtype != torch.float32 for p in params)
    weights = [(w, o) for w, o in zip(opt._model_weights(), opt.masters) if w is not None]
    assert weights and all(torch.equal(w, o.to(w.dtype)) for w, o in weights), "the weights: masters rounded to nearest"


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_fused_adamw_with_bf16_moments_matches_the_reference_step(monkeypatch, distributed):
    """--use-precision-aware-optimizer with bf16 moments: the kernel reads and writes them in bf16 (rounded to
    nearest on CUDA) and steps as paratron/optim/moments.py's reference step (--kernel-fused-adamw off) does."""
    flags = FLAGS + ["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype",
                     "bf16"] + (["--use-distributed-optimizer"] if distributed else [])
    params, opt, applied = _run(monkeypatch, True, flags)
    _, ref, ref_applied = _run(monkeypatch, False, flags)
    assert applied == ref_applied == [True, True, False, True]
    # The kernel's fp32 arithmetic and torch's differ in the last bits (see the test above); where that puts a
    # moment on the other side of a bf16 rounding boundary, the two runs hold neighbouring bf16 moments (2 ** -8
    # apart) and their later updates differ by up to that fraction of a step. So: nearly every element of the
    # masters as close as with fp32 moments, and none further apart than 2 ** -6 of the learning rates summed
    # (a wrong rounding or a moment not stored moves about half the elements by a sizeable part of a step).
    lr_sum = 4e-3 + 3e-3 + 1e-3 + 3e-3 + 1.5e-3 + 0.75e-3  # the steps applied, both learning rates (an upper bound)
    for m, n in zip(opt.masters, ref.masters):
        off = (m - n).abs()
        assert off.max() <= lr_sum * 2 ** -6, (tuple(m.shape), off.max())
        assert (off > 1e-6).float().mean() <= 0.01, (tuple(m.shape), (off > 1e-6).float().mean())
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = opt.adam.state[m][k], ref.adam.state[n][k]
            assert a.dtype == b.dtype == torch.bfloat16
            # one bf16 step apart at most (an fp32 value a few ulps apart may round to neighbouring bf16 values)
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7 + 1e-30).all(), k
