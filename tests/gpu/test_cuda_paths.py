"""CUDA-only paths, run on the device machine (skipped without a GPU): the fused optimizer step with
clipping folded into the kernel against the CPU path, a sharded checkpoint of CUDA tensors saved,
resharded nowhere, loaded and continued (bf16, and FP8 with the delayed recipe), the Triton SwiGLU
kernel (eager and inside a compiled region) against the torch expression, and the FP8 SwiGLU kernels
against theirs."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(device: str, clip: float, grad_mult: float):
    from paratron.config import parse_args
    from paratron.optim.optimizer import Optimizer
    from paratron.parallel.dims import ParallelDims
    g = torch.Generator().manual_seed(0)  # the same numbers on both devices: drawn on the CPU
    params = [torch.nn.Parameter(torch.randn(64, 32, generator=g).to(device)),
              torch.nn.Parameter(torch.randn(32, generator=g).to(device))]
    for p in params:
        p.main_grad = (torch.randn(p.shape, generator=g) * grad_mult).to(device)
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
                      "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-2",
                      "--mock-data", "--clip-grad", str(clip), "--weight-decay", "0.1", "--device", device])
    opt = Optimizer(params, cfg, ParallelDims())
    ok, norm = opt.step()
    return [p.detach().cpu() for p in params], float(norm), bool(ok)


@pytest.mark.parametrize("clip,mult", [(1.0, 10.0), (1.0, 0.001), (0.0, 10.0)])
def test_fused_step_with_clipping_matches_the_cpu_step(clip, mult):
    cpu, n_cpu, ok_cpu = _step("cpu", clip, mult)
    gpu, n_gpu, ok_gpu = _step("cuda", clip, mult)
    assert ok_cpu and ok_gpu and abs(n_cpu - n_gpu) <= 1e-5 * n_cpu
    for a, b in zip(cpu, gpu):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_fused_step_skips_inf_gradients():
    from paratron.config import parse_args
    from paratron.optim.optimizer import Optimizer
    from paratron.parallel.dims import ParallelDims
    p = torch.nn.Parameter(torch.randn(16, 16, device="cuda"))
    p.main_grad = torch.full_like(p, float("inf"))
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
                      "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-2",
                      "--mock-data", "--clip-grad", "1.0", "--device", "cuda"])
    before = p.detach().clone()
    ok, _ = Optimizer([p], cfg, ParallelDims()).step()
    assert not bool(ok) and torch.equal(p.detach(), before)


TINY_CUDA_RUN = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
                 "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
                 "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--lr", "1e-3",
                 "--train-iters", "6", "--bf16", "--eval-iters", "0", "--device", "cuda"]


def _straight_and_resumed(flags, tmp_path, runs=1, save_flags=()):
    """Losses of ``runs`` runs of 6 straight steps, and of 3 steps + save + load + 3 steps."""
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    flags = [*flags, "--save", str(tmp_path / "ck")]

    def losses(t, n):
        return [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(n))]

    straight = [losses(Trainer(parse_args(flags)), 6) for _ in range(runs)]
    first = Trainer(parse_args([*flags, *save_flags]))
    got = losses(first, 3)
    first.save()
    first.wait_for_save()
    second = Trainer(parse_args(flags + ["--load", str(tmp_path / "ck")]))
    assert second.iteration == 3
    return straight, got + losses(second, 3)


def test_cuda_checkpoint_resumes_with_the_same_losses(tmp_path):
    (straight,), got = _straight_and_resumed(TINY_CUDA_RUN, tmp_path, save_flags=["--async-save"])
    for a, b in zip(straight, got):
        assert abs(a - b) <= 1e-3 * abs(a), (straight, got)


def test_checkpoints_over_nccl_with_disable_gloo_process_groups(tmp_path):
    """--disable-gloo-process-groups under torchrun on one GPU: the checkpoint collectives run on an NCCL group
    (the asynchronous save's thread on the run's device), the save completes and the next run resumes from it."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            os.path.join(root, "pretrain_gpt.py"), *TINY_CUDA_RUN, "--disable-gloo-process-groups", "--async-save",
            "--save", str(tmp_path / "ck"), "--log-interval", "1"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    first = subprocess.run(base + ["--exit-interval", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    second = subprocess.run(base + ["--load", str(tmp_path / "ck")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert second.returncode == 0 and "resumed from" in second.stdout, (second.stdout[-2000:], second.stderr[-2000:])
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_log_energy_on_the_log_line(capsys):
    """--log-energy on a GPU: NVML's counter gives a positive energy per iteration and a power within the GPU's
    range on every log line."""
    import re
    from paratron.train.energy import nvml
    from paratron.train.loop import pretrain
    from paratron.train.resolve import parse_args
    if nvml() is None:
        pytest.skip("nvidia-ml-py (pynvml) is not installed")
    pretrain(parse_args(TINY_CUDA_RUN + ["--log-energy", "--log-interval", "2"]))
    found = re.findall(r"energy per GPU \(J/iter/GPU\): ([0-9.]+) \| power per GPU \(W/GPU\): ([0-9.]+)",
                       capsys.readouterr().out)
    assert len(found) == 3 and all(float(j) > 0 and 10 < float(w) < 2000 for j, w in found), found


def test_fp8_delayed_resume_continues_the_same_run(tmp_path):
    """FP8 with the delayed recipe: 3 steps, save, load, 3 steps give the losses of 6 straight steps
    (the amax histories travel in the checkpoint). Bitwise when two straight runs agree bitwise (the
    GPU's deterministic path); otherwise within the straight runs' own difference."""
    flags = [*TINY_CUDA_RUN, "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
             "--position-embedding-type", "rope", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
             "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]
    (straight, again), got = _straight_and_resumed(flags, tmp_path, runs=2)
    if straight == again:
        assert got == straight, (straight, got)
    else:
        noise = max(abs(a - b) for a, b in zip(straight, again))
        assert all(abs(a - b) <= max(2 * noise, 1e-6) for a, b in zip(straight, got)), (straight, again, got)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_swiglu_kernel_matches_torch(compiled):
    from paratron.kernels.swiglu import swiglu, swiglu_reference
    torch.manual_seed(0)
    fn = torch.compile(lambda t: swiglu(t) * 2.0) if compiled else (lambda t: swiglu(t) * 2.0)
    for shape in ((2048, 4, 2 * 8192), (3, 5, 2 * 1000)):
        h = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=torch.bfloat16)
        out = fn(h)
        out.backward(g)
        ref_h = h.detach().double().requires_grad_()
        ref = swiglu_reference(ref_h) * 2.0
        ref.backward(g.double())
        for got, want in ((out, ref), (h.grad, ref_h.grad)):
            assert got.dtype == torch.bfloat16
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("act,bias", [(0, False), (0, True), (1, True), (2, True), (1, False)])
@pytest.mark.parametrize("e5m2", [True, False])
def test_fp8_mlp_kernels_match_the_torch_ops(act, bias, e5m2):
    """The Triton kernels of parallel/fp8_mlp.py (SwiGLU 0, GeLU 1, tanh GeLU 2; with an fc1 bias or not)
    against its torch expressions (the gradient by autograd), with the tensor's own scale (tensorwise:
    amax pass + cast pass) and with a preset one (delayed: the cast pass alone, which also returns the
    amax): the same scale, amax and bias gradient, the same FP8 values but for rare one-step rounding
    flips (transcendentals' last bit), row-major = transposed."""
    from paratron.fp8 import mlp as fp8_mlp
    torch.manual_seed(0)
    for m, f in ((4096, 8192), (272, 1000)):  # llama-1b's width; a masked edge in both directions
        cols = 2 * f if act == fp8_mlp.SWIGLU else f
        h = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if bias else None
        dout = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
        for preset in (torch.tensor(0.0, device="cuda"), torch.tensor(37.5, device="cuda")):
            pairs = ((torch.ops.paratron.mlp_act_fp8(h, b, preset, act, 0),
                      fp8_mlp.act_fp8_reference(h, b, preset, act, 0)),
                     (torch.ops.paratron.mlp_act_fp8_backward(h, b, dout, preset, act, e5m2, 0),
                      fp8_mlp.grad_fp8_reference(h, b, dout, preset, act, e5m2, 0)))
            for got, want in pairs:
                q, qt, scale, current = got[:4]
                rq, _, rscale, rcurrent = want[:4]
                assert q.dtype == rq.dtype and q.shape == rq.shape and torch.equal(qt, q.t())
                assert abs(scale.item() / rscale.item() - 1) < 1e-6
                assert abs(current.item() / rcurrent.item() - 1) < 1e-5
                differ = (q.float() != rq.float()).float().mean().item()
                assert differ < 1e-3, differ
                assert ((q.float() - rq.float()).norm() / rq.float().norm()).item() < 1e-3
            db, rdb = pairs[1][0][4], pairs[1][1][4]
            assert db.shape == rdb.shape == ((cols,) if bias else (0,))
            if bias:
                assert ((db - rdb).norm() / rdb.norm()).item() < 1e-5


@pytest.mark.parametrize("e5m2", [True, False])
def test_fp8_cast_kernel_matches_the_torch_cast(e5m2):
    """paratron::cast_fp8 (the output gradients' cast: the fused kernels with no activation) against the
    torch cast: own scale and preset one, byte-equal FP8 (a cast has no transcendental to flip a last
    bit), the transposed copy equal to the row-major one transposed, the same amax."""
    from paratron.fp8 import mlp as fp8_mlp
    from paratron.kernels import fp8_cast
    from paratron.fp8 import E4M3, E5M2
    torch.manual_seed(0)
    for m, n in ((4096, 3072), (272, 1000)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 30
        for preset in (torch.tensor(0.0, device="cuda"), torch.tensor(2.5, device="cuda")):
            q, qt, scale, current = torch.ops.paratron.cast_fp8(x, preset, e5m2, 0)
            rq, _, rscale, rcurrent = fp8_cast._to_fp8(x.float(), preset, E5M2 if e5m2 else E4M3, 0)
            assert q.dtype == rq.dtype and torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
            assert scale.item() == pytest.approx(rscale.item(), rel=1e-6)
            assert current.item() == pytest.approx(rcurrent.item(), rel=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_fp8_mlp_compiled_equals_eager(recipe):
    """Eager and Inductor-compiled fused MLP (for delayed: primed after a first call, so the casts are
    the single-pass ones) give the same outputs, gradients and amax histories."""
    from paratron import fp8
    from paratron.fp8 import mlp as fp8_mlp
    from paratron.fp8 import FP8State, Recipe
    torch.manual_seed(0)
    x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(2 * 2048, 1024, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(1024, 2048, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    g = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    outs, hist = [], []
    for fn in (fp8_mlp.fused_mlp, torch.compile(fp8_mlp.fused_mlp)):
        states = [FP8State(Recipe(recipe=recipe, amax_history_len=8, amax_compute_algo="max"), "cuda")
                  for _ in range(2)]
        for call in range(2):
            for t in (x, w1, w2):
                t.grad = None
            y = fn(x * (2 - call), w1, None, w2, *states)  # the delayed scale of call 1 is from 2x: no saturation
            y.backward(g)
            fp8.prime(states)
        outs.append([y.detach(), x.grad.clone(), w1.grad.clone(), w2.grad.clone()])
        hist.append(fp8.histories(states) if recipe == "delayed" else torch.zeros(1))
    assert torch.allclose(hist[0], hist[1], rtol=1e-3) and (recipe != "delayed" or hist[0].count_nonzero() == 12)
    ref = fp8_mlp.reference_mlp(x.detach().float(), w1.detach().float(), w2.detach().float())
    rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*outs)]
    assert max(rel) < 1e-2, rel
    err = ((outs[0][0].float() - ref).norm() / ref.norm()).item()
    assert err < 0.1, err  # two FP8 matmuls in a row (measured 0.066 at this shape: x ~ N(0, 1))


def test_gradient_accumulation_kernel_equals_torch_add_and_copy():
    from paratron.kernels import accumulate as kernels
    torch.manual_seed(0)
    for n in (16384 * 2048, 4097, 3):
        g = torch.randn(n, device="cuda").bfloat16()
        acc = torch.randn(n, device="cuda")
        want = acc + g.float()
        kernels.accumulate_(acc, g, write=False)
        assert torch.equal(acc, want)
        kernels.accumulate_(acc, g, write=True)
        assert torch.equal(acc, g.float())
