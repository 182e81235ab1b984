"""The AdamW kernel of paratron/optim/fused_adamw.py, run through Triton's CPU interpreter (it runs on
CUDA in tests/gpu/test_fused_adamw_cuda.py): several steps against torch.optim.AdamW (foreach) on fp64
copies of the same masters, with the model weights it writes against the masters rounded by torch; and the
optimizer's on-device step taking it (no publishing copy) against the plain CPU step."""
import pytest

pytest.importorskip("triton")

from tests.interpret import interpret as _interpret  # noqa: E402



KERNEL = r"""
import torch
from paratron.kernels.fused_adamw import BLOCK, adamw_step_
torch.manual_seed(0)
# two groups with their own lr / weight decay / betas / eps; a master over more than one block whose size is
# not a multiple of it, one with a bf16 and one with an fp16 model weight, one stepped alone (an fp32 parameter)
shapes = [[(3, BLOCK // 2 + 7), (37,)], [(5, 7)]]
hyper = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)]
init = [[torch.randn(s) for s in group] for group in shapes]
mine = [[t.clone() for t in group] for group in init]
start = {p: t for p, t in zip(sum(mine, []), sum(init, []))}
ref = [[t.clone().double() for t in group] for group in init]  # (fp64: torch's fp32 CPU AdamW itself drifted
# from the exact step by up to 8e-7 in some processes and not in others, which made this test flaky)
adam = torch.optim.AdamW([dict(params=ps, **h) for ps, h in zip(mine, hyper)], betas=(0.9, 0.999), eps=1e-8)
want_adam = torch.optim.AdamW([dict(params=ps, **h) for ps, h in zip(ref, hyper)], betas=(0.9, 0.999), eps=1e-8,
                              foreach=True)
outs = {mine[0][0]: mine[0][0].bfloat16(), mine[1][0]: mine[1][0].half()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rounded(out, p):
    # out is p rounded to its dtype: to nearest as torch rounds, or, for bf16, cut (the interpreter's
    # fp32 -> bf16 conversion truncates; the CUDA test asserts the rounding)
    cut = (p.view(torch.int32) & ~0xFFFF).view(torch.float32).to(out.dtype) if out.dtype == torch.bfloat16 else None
    return bool(((out == p.to(out.dtype)) | ((out == cut) if cut is not None else False)).all())


def check(step):
    for p, q in zip(sum(mine, []), sum(ref, [])):
        # the parameters, and what the steps moved them by (fp32 rounding of parameters near 1 against steps near
        # 1e-2: up to ~9e-6 of them)
        assert rel(p, q) <= 1e-7 and rel(p - start[p], q - start[p]) <= 2e-5, (step, p.shape, rel(p, q),
                                                                                rel(p - start[p], q - start[p]))
        s, t = adam.state[p], want_adam.state[q]
        assert s["step"].item() == t["step"].item() == step, (s["step"], t["step"], step)
        for k in ("exp_avg", "exp_avg_sq"):
            assert rel(s[k], t[k]) <= 1e-6, (step, k, rel(s[k], t[k]))
    for p, out in outs.items():
        assert rounded(out, p), (step, p.shape)


# (lr of the first group, grad_scale, found_inf): a scheduled lr, clipping, an overflow, clean steps again
plan = [(1e-2, None, 0.0), (8e-3, 3.7, 0.0), (6e-3, 2.0, 1.0), (6e-3, 1.0, 0.0), (4e-3, 5.0, 0.0)]
step, tables = 0, {}
for lr, scale, inf in plan:
    adam.param_groups[0]["lr"] = want_adam.param_groups[0]["lr"] = lr
    grads = [torch.randn_like(p) for p in sum(mine, [])]
    if inf:
        grads[1][3] = float("inf")
        before = [t.clone() for t in sum(mine, [])] + [adam.state[p][k].clone() for p in sum(mine, [])
                                                         for k in ("exp_avg", "exp_avg_sq")]
    for p, g in zip(sum(mine, []), grads):
        p.grad = g
    adamw_step_(adam, outs, None if scale is None else torch.tensor(scale), torch.tensor(inf), tables)
    if inf:  # nothing moved, the step counters included
        after = [t for t in sum(mine, [])] + [adam.state[p][k] for p in sum(mine, []) for k in ("exp_avg", "exp_avg_sq")]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    else:
        step += 1
        for q, g in zip(sum(ref, []), grads):
            q.grad = g.double() if scale is None else g.double() / scale
        want_adam.step()
    check(step)
# one launch per group and dtypes (group 0: a master with a bf16 weight, one without; group 1: fp16); each step
# above had new gradient tensors, so new tables; with the same tensors (two skipped steps) the tables are kept
assert len(tables) == 3, tables.keys()
first = {k: v[1][0] for k, v in tables.items()}
adamw_step_(adam, outs, None, torch.tensor(1.0), tables)
assert len(tables) == 3 and all(tables[k][1][0] is first[k] for k in first)
mine[0][1].grad = mine[0][1].grad.clone()  # an address changed: that batch's table is built again
adamw_step_(adam, outs, None, torch.tensor(1.0), tables)
assert [tables[k][1][0] is first[k] for k in first] == [True, False, True]
print("ok")
"""


def test_adamw_kernel_matches_torch_adamw_in_the_interpreter():
    _interpret(KERNEL)


OPTIMIZER = r"""
import os
import torch
from paratron.config import parse_args
from paratron.kernels import fused_adamw
from paratron.optim.optimizer import Optimizer
from paratron.parallel.dims import ParallelDims

flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-2",
         "--mock-data", "--clip-grad", "1.0", "--weight-decay", "0.1", "--bf16"]
half = flags[:-1] + ["--fp16", "--loss-scale", "1024"]  # fp16 weights, a constant loss scale (the gradients scaled)
cfgs = {(f, fp16): parse_args((half if fp16 else flags) + ([] if f else ["--kernel-fused-adamw", "off"]))
        for f in (True, False) for fp16 in (True, False)}
g = torch.Generator().manual_seed(0)
init = [torch.randn(64, 40, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()]
grads = [[torch.randn(t.shape, generator=g) * 3 for t in init] for _ in range(3)]
grads[1][0][0, 0] = float("nan")  # the second step overflows: skipped


def no_copy(copied=False):
    assert copied, "the kernel wrote the model weights: the masters must not be copied into them again"


def no_widening():
    raise AssertionError("the step widened the bf16 gradient buffers into fp32 copies")


def run(fused, grad_dtype=torch.float32, fp16=False):
    cfg = cfgs[fused, fp16]
    params = [torch.nn.Parameter(t.clone().half() if fp16 else t.clone()) for t in init]
    names = {params[0]: "decoder.layers.0.mlp.linear_fc1.weight", params[1]: "decoder.layers.0.mlp.linear_fc1.bias"}
    opt = Optimizer(params, cfg, ParallelDims(), names)
    assert (opt._fused_outs is not None) == fused and len(opt.adam.param_groups) == 2  # with and without decay
    if fused:
        opt._publish = no_copy
    if fused and grad_dtype == torch.bfloat16:  # no loss scale: the kernel and the norm read the buffers themselves
        opt._grads = no_widening
    applied = []
    for gs in grads:
        for p, gr in zip(params, gs):
            # (bf16 / fp16 buffers: the kernel reads the buffer itself, not the optimizer's fp32 copy, and with a
            # loss scale unscales as it reads)
            p.main_grad = (gr * opt.loss_scale).to(grad_dtype)
        applied.append(bool(opt.step()[0]))
    return params, opt, applied


fused_adamw.available = lambda device: True  # the CPU tensors go through the interpreted kernel
got, opt, applied = run(True)
want, ref, ref_applied = run(False)
assert applied == ref_applied == [True, False, True], (applied, ref_applied)
for p, q, m, n in zip(got, want, opt.masters, ref.masters):
    cut = (m.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()  # the interpreter's fp32 -> bf16
    assert ((p == m.bfloat16()) | (p == cut)).all(), "the model weights are the rounded masters"
    assert ((m - n).norm() / n.norm()).item() <= 1e-6
    assert int(opt.adam.state[m]["step"]) == int(ref.adam.state[n]["step"]) == 2
for grad_dtype, fp16 in ((torch.bfloat16, False), (torch.float16, True), (torch.float32, True)):
    got, opt, applied = run(True, grad_dtype, fp16)
    want, ref, _ = run(False, grad_dtype, fp16)
    assert applied == [True, False, True] and opt.loss_scale == (1024 if fp16 else 1)
    for m, n in zip(opt.masters, ref.masters):
        assert ((m - n).norm() / n.norm()).item() <= 1e-6, (grad_dtype, fp16, ((m - n).norm() / n.norm()).item())
        for k in ("exp_avg", "exp_avg_sq"):  # (Adam's update hardly moves with the gradients' scale; its moments do)
            a, b = opt.adam.state[m][k], ref.adam.state[n][k]
            assert ((a - b).norm() / b.norm()).item() <= 1e-6, (grad_dtype, fp16, k)
print("ok")
"""


def test_optimizer_on_device_step_takes_the_kernel_in_the_interpreter():
    _interpret(OPTIMIZER)


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_step_counters_advance_without_reading_found_inf_on_the_host(found):
    """found_inf stays a device tensor: no ``_local_scalar_dense`` (an ``.item()``: on CUDA a host
    synchronisation every step, seen by benchmarks/host_sync.py on an H200), and the counters move by 1 - found."""
    import torch
    from paratron.kernels.fused_adamw import advance_steps
    from paratron.train.host_ops import OpCounter

    steps = [torch.full((), 3.0), torch.full((), 5.0)]
    with OpCounter() as seen:
        advance_steps(steps, torch.tensor(found))
    assert not [op for op in seen.ops if "_local_scalar_dense" in op], seen.ops
    assert [s.item() for s in steps] == [4.0 - found, 6.0 - found]
    advance_steps(steps, None)
    assert [s.item() for s in steps] == [5.0 - found, 7.0 - found]
