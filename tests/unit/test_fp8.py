"""FP8 scaling and matmuls (paratron/parallel/fp8.py) on CPU: hand-computed scales, saturation, the
delayed recipe's history, the emulated FP8 linear against fp32, the real torch._scaled_mm path where
this torch runs it on CPU, the layers' wiring, and the config errors."""
import subprocess
import sys

import pytest
import torch

from paratron.config import ConfigError
from paratron.train.resolve import parse_args
from paratron import fp8
from paratron.fp8 import recipe as fp8_recipe
from paratron.fp8 import E4M3, E5M2, FP8State, Recipe, Scaler
from paratron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

BASE = ["--mock-data", "--train-iters", "2", "--lr", "1e-3", "--micro-batch-size", "2", "--device", "cpu"]


def test_scale_from_amax_and_margin():
    assert fp8.compute_scale(torch.tensor(2.0), 448.0).item() == 224.0
    assert fp8.compute_scale(torch.tensor(2.0), 448.0, margin=2).item() == 56.0  # 448 / (2 * 4)
    assert fp8.compute_scale(torch.tensor(4.0), 57344.0, margin=1).item() == 7168.0
    for bad in (0.0, float("inf"), float("nan"), 1e-45):  # 1e-45: the quotient overflows fp32
        assert fp8.compute_scale(torch.tensor(bad), 448.0).item() == 1.0
    assert fp8.amax(torch.tensor([[-3.0, 1.0], [2.5, 0.0]])).item() == 3.0


def test_saturation_and_round_trip():
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.0])
    q = fp8.quantize(x, torch.tensor(1.0), E4M3)
    assert q.dtype == E4M3 and q.float().tolist() == [448.0, -448.0, 1.0, 0.0]
    q = fp8.quantize(torch.tensor([1e6, -1e6]), torch.tensor(1.0), E5M2)
    assert q.float().tolist() == [57344.0, -57344.0]
    assert not torch.isnan(fp8.quantize(torch.tensor([1e9]), torch.tensor(1.0), E4M3).float()).any()
    # with the tensorwise scale the largest value maps to fmax exactly and comes back exactly
    x = torch.tensor([0.5, -4.0, 2.0])
    s = fp8.compute_scale(fp8.amax(x), 448.0)
    q = fp8.quantize(x, s, E4M3)
    assert q.float().abs().max().item() == 448.0
    assert torch.equal(fp8.dequantize(q, s), x)  # scale 112: 56, -448, 224 are e4m3 values
    assert fp8.dequantize(fp8.quantize(torch.tensor([0.6]), s, E4M3), s).item() == 0.5714285969734192  # 67.2 -> 64


def test_tensorwise_uses_the_current_amax():
    s = Scaler(Recipe(recipe="tensorwise"), E4M3)
    assert s.scale_for(torch.tensor([2.0])).item() == 224.0
    assert s.scale_for(torch.tensor([4.0])).item() == 112.0
    assert s.history is None


def test_delayed_history_roll_max_and_most_recent():
    mx = Scaler(Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo="max"), E4M3)
    mr = Scaler(Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo="most_recent"), E4M3)
    got_max, got_recent = [], []
    for a in (2.0, 8.0, 1.0, 4.0, 0.5):
        got_max.append(mx.scale_for(torch.tensor([a])).item())
        got_recent.append(mr.scale_for(torch.tensor([a])).item())
    # first use: the current amax (nothing recorded yet); then the history before this amax
    assert got_recent == [224.0, 224.0, 56.0, 448.0, 112.0]  # 448 / (2, 2, 8, 1, 4)
    assert got_max == [224.0, 224.0, 56.0, 56.0, 56.0]  # 448 / max of (2), (8, 2), (1, 8, 2), (4, 1, 8)
    assert mx.history.tolist() == [0.5, 4.0, 1.0]  # newest first, length 3, rolled after each use
    m = Scaler(Recipe(recipe="delayed", amax_history_len=2, amax_compute_algo="max", margin=1), E5M2)
    m.scale_for(torch.tensor([3.0]))
    assert m.scale_for(torch.tensor([1.0])).item() == pytest.approx(57344.0 / 6.0, rel=1e-7)  # fp32


def test_primed_delayed_scale_comes_from_the_history_alone():
    """Primed (after a training step), the scale no longer looks at the current amax, even where the
    history holds none; the preset scale the fused MLP gets is 0 (= use your own amax) only for
    tensorwise and for an unprimed empty history."""
    s = Scaler(Recipe(recipe="delayed", amax_history_len=2, amax_compute_algo="max"), E4M3, "cpu")
    assert s.preset_scale("cpu").item() == 0.0  # nothing recorded: the current amax decides
    assert s.scale_for(torch.tensor([2.0])).item() == 224.0
    assert s.preset_scale("cpu").item() == 224.0
    fp8.prime([type("St", (), {"scalers": (s,)})])
    assert s.primed and s.scale_for(torch.tensor([8.0])).item() == 224.0  # the history's 2, not 8
    assert s.history.tolist() == [8.0, 2.0]
    empty = Scaler(Recipe(recipe="delayed"), E5M2, "cpu")
    empty.primed = True
    assert empty.preset_scale("cpu").item() == 1.0 and empty.scale_for(torch.tensor([4.0])).item() == 1.0
    assert Scaler(Recipe(), E4M3).preset_scale("cpu").item() == 0.0


def _linear_case(fmt="hybrid", recipe="tensorwise", emulate=True):
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(32, 48, dtype=torch.bfloat16) * 1e-3
    state = FP8State(Recipe(format=fmt, recipe=recipe, emulate=emulate))
    state.trace = []
    y = fp8.fp8_linear(x, w, state)
    y.backward(g)
    return x, w, g, y, state


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fmt,grad_dtype", [("hybrid", E5M2), ("e4m3", E4M3)])
def test_emulated_linear_close_to_fp32_and_gradient_format(fmt, grad_dtype):
    x, w, g, y, state = _linear_case(fmt)
    assert state.trace == [("input", E4M3), ("weight", E4M3), ("grad", grad_dtype)]
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = xf @ wf.t()
    yf.backward(g.float())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert _rel(y, yf) < 0.06  # e4m3: 3 mantissa bits, relative rounding error <= 1/16 per element
    limit = 0.12 if fmt == "hybrid" else 0.06  # e5m2 gradients: 2 mantissa bits
    assert _rel(x.grad, xf.grad) < limit and _rel(w.grad, wf.grad) < limit
    assert _rel(y, yf) > 0  # really quantised


def test_hybrid_gradients_are_coarser_than_e4m3():
    errs = {}
    for fmt in ("hybrid", "e4m3"):
        x, w, g, _, _ = _linear_case(fmt)
        xf = x.detach().float().requires_grad_()
        (xf @ w.detach().float().t()).backward(g.float())
        errs[fmt] = _rel(x.grad, xf.grad)
    assert errs["hybrid"] > errs["e4m3"]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_real_scaled_mm_matches_emulation_on_cpu(recipe):
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=E4M3), torch.zeros(16, 16, dtype=E4M3).t(), torch.tensor(1.0),
                         torch.tensor(1.0), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU torch._scaled_mm for float8")
    real = _linear_case(recipe=recipe, emulate=False)
    emu = _linear_case(recipe=recipe, emulate=True)
    for a, b in ((real[3], emu[3]), (real[0].grad, emu[0].grad), (real[1].grad, emu[1].grad)):
        assert _rel(a, b) < 1e-2  # same FP8 operands and scales; only the accumulation and rounding differ


def test_layers_use_fp8_and_keep_bias_and_residual():
    torch.manual_seed(1)
    col = ColumnParallelLinear(64, 32, bias=True, dtype=torch.bfloat16)
    row = RowParallelLinear(32, 64, bias=False, dtype=torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    res = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        col.bias.normal_()
    ref = row(col(x), residual=res)
    recipe = Recipe(emulate=True)
    col.fp8, row.fp8 = FP8State(recipe), FP8State(recipe)
    out = row(col(x), residual=res)
    assert 0 < _rel(out - res, ref - res) < 0.1
    assert col.fp8.weight.dtype == E4M3


def test_model_attaches_fp8_to_the_four_block_layers_only():
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                      "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                      "--disable-bias-linear", *BASE]).model
    model = GPTModel(cfg, 256, fp8=Recipe(emulate=True), dtype=torch.bfloat16)
    with_fp8 = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if getattr(m, "fp8", None)})
    assert with_fp8 == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert model.output_layer.fp8 is None
    ids = torch.randint(0, 256, (2, 16))
    loss = model(ids, None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    assert "fp8" not in " ".join(model.state_dict())  # checkpoints unchanged


@pytest.mark.parametrize("flags,message", [
    (["--fp8-format", "hybrid", "--fp16"], "--fp8-format with --fp16 is not supported"),
    (["--fp8-format", "e5m2", "--bf16"], "--fp8-format must be e4m3 or hybrid"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise keeps every tensor "
     "in e4m3"),
    (["--fp8-format", "e4m3", "--bf16", "--fp8-recipe", "blockwise", "--hidden-size", "64"],
     "--fp8-recipe blockwise needs FP8 GEMM sizes that are multiples of 128; --hidden-size is 64"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "mxfp8"], "Blackwell"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-amax-compute-algo", "mean"], "max or most_recent"),
    (["--fp8-format", "e4m3", "--fp8-hybrid", "--bf16"], "contradicts"),
    (["--fp8-format", "hybrid", "--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--fp8-recipe delayed with --recompute-granularity full"),
    (["--fp8-format", "hybrid", "--bf16", "--hidden-size", "72", "--num-attention-heads", "4"],
     "multiples of 16; --hidden-size is 72"),
])
def test_config_errors(flags, message):
    with pytest.raises(ConfigError, match=None) as err:
        parse_args([*BASE, *flags])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp8_defaults_are_megatrons():
    tr = parse_args(BASE).train
    assert (tr.fp8_format, tr.fp8_recipe, tr.fp8_amax_history_len, tr.fp8_amax_compute_algo, tr.fp8_margin) == (
        None, "delayed", 1, "most_recent", 0)
    assert Recipe.from_config(tr) is None


def test_fp8_on_a_cpu_runs_the_recipe_emulated_and_says_so():
    """A CPU run takes --fp8-format (trying an FP8 configuration on a laptop): the recipe's numbers through
    dequantised fp32 matmuls, said at start-up; it learns."""
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
    from tests.parallel.cli import run_script
    r = run_script(1, "-m", ["paratron", "train", *BASE, *tiny, "--train-iters", "10", "--lr", "1e-2", "--fp8-format",
                             "hybrid", "--bf16", "--eval-iters", "0", "--log-interval", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FP8 linears: 8 delayed" in r.stdout and "on the CPU: the recipe emulated" in r.stdout
    losses = [float(x) for x in __import__("re").findall(r"lm loss: ([0-9.E+-]+)", r.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses


def test_a_gpu_without_fp8_tensor_cores_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert fp8.device_problem("cuda") == ("--fp8-format needs an FP8-capable GPU (Hopper/Ada, compute capability >= "
                                          "8.9); this run is on NVIDIA A100-SXM4-80GB (compute capability 8.0)")
    assert fp8.device_problem("cpu") is None


def test_delayed_history_is_checkpointed_and_resume_is_bit_exact(tmp_path, monkeypatch):
    """CPU stands in for an FP8 GPU here (this torch runs torch._scaled_mm on CPU): 2N steps straight
    == N steps, save, load, N more, with the amax histories restored."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    n = 2
    flags = TINY + ["--train-iters", str(2 * n), "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                    "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo", "max", "--device", "cpu",
                    "--kernel-fp8-weight-cache", "on"]
    straight = Trainer(parse_args(flags))
    ref = losses_of(straight, 2 * n)
    first = Trainer(parse_args(flags + ["--save", str(tmp_path / "ck")]))
    got = losses_of(first, n)
    saved = fp8.histories(fp8.delayed_states([first.model]))
    # 2 layers x 4 FP8 linears x 3 tensors x history 8; n steps of 2 micro-batches recorded so far: the input's
    # and the output gradient's amax at each micro-batch, the weight's once a step (cast once: fp8/weights.py)
    assert saved.numel() == 2 * 4 * 3 * 8 and saved.count_nonzero() == 2 * 4 * (2 + 2 + 1) * n
    first.save()
    second = Trainer(parse_args(flags + ["--load", str(tmp_path / "ck")]))
    assert torch.equal(fp8.histories(fp8.delayed_states([second.model])), saved)
    got += losses_of(second, n)
    assert got == ref and all(torch.isfinite(torch.tensor(ref)))
    assert torch.equal(fp8.histories(fp8.delayed_states([second.model])),
                       fp8.histories(fp8.delayed_states([straight.model])))
    bf16 = Trainer(parse_args([f for f in flags if f not in ("hybrid", "delayed", "--fp8-format", "--fp8-recipe")]
                              + ["--load", str(tmp_path / "ck")]))  # an FP8 checkpoint resumes in bf16
    assert bf16.iteration == n and not fp8.delayed_states([bf16.model])


def test_fp8_check_benchmark_runs_on_cpu():
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "fp8_check.py"), "--cpu"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| linear_fc2 |" in r.stdout and "skipping (b) matmul speed and (c) training throughput" in r.stdout


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_casts_equal_eager(monkeypatch, recipe):
    """The compiled amax / cast kernels (used on CUDA outside compiled regions) give the eager bits."""
    eager = _linear_case(recipe=recipe)
    monkeypatch.setattr(fp8_recipe, "FUSED_CAST_DEVICES", ("cuda", "cpu"))
    fp8_recipe._compiled.cache_clear()
    fused = _linear_case(recipe=recipe)
    assert fp8_recipe._compiled.cache_info().currsize == 2  # the amax and the cast, each compiled once
    assert torch.equal(eager[3], fused[3])  # y
    assert torch.equal(eager[0].grad, fused[0].grad) and torch.equal(eager[1].grad, fused[1].grad)


def test_moe_model_says_which_linears_fp8_covers(monkeypatch, capsys):
    """With --fp8-format an MoE model runs attention, the shared expert and the routed experts' grouped
    GEMMs in FP8, and says so once at start-up with the count of each (CPU standing in for an FP8 GPU)."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = TINY + ["--train-iters", "2", "--bf16", "--fp8-format", "hybrid", "--device", "cpu", "--num-experts", "4",
                    "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size",
                    "32", "--moe-grouped-gemm", "--kernel-fp8-weight-cache", "on"]
    trainer = Trainer(parse_args(flags))
    out = capsys.readouterr().out
    # two layers of QKV, proj, the shared expert's fc1 / fc2 and the experts' fc1 / fc2, all in the run's recipe
    # (the experts' biases keep them GEMM by GEMM: fp8/experts_mlp.py)
    want = ("FP8 linears: 12 delayed; in the parameters' dtype: 0; routed experts: 2 GEMM by GEMM (expert biases); "
            "weights cast once per step of several micro-batches (the routed experts' at every micro-batch); embed")
    assert out.count(want) == 1, out
    with_state = {n for n, m in trainer.model.named_modules() if getattr(m, "fp8", None) is not None}
    assert any(n.endswith("linear_qkv") for n in with_state) and any("shared_experts" in n for n in with_state)
    assert any(n.endswith(".experts.linear_fc1") for n in with_state), with_state
    assert all(torch.isfinite(torch.tensor(losses_of(trainer, 2))))
    dense = Trainer(parse_args(TINY + ["--train-iters", "1", "--bf16", "--fp8-format", "hybrid", "--device", "cpu"]))
    assert dense is not None and "FP8 linears: 8 delayed; in the parameters' dtype: 0" in capsys.readouterr().out


def test_first_last_layers_stay_in_bf16(monkeypatch):
    """--first-last-layers-bf16 (Megatron's): the first N and last M decoder layers get no FP8 state,
    the others do; it trains; without --fp8-format, or with more edge layers than layers, one-line errors."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.config import ConfigError
    from paratron.train.loop import Trainer
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = [f for f in TINY] + ["--train-iters", "2", "--bf16", "--fp8-format", "hybrid", "--device", "cpu"]
    flags[flags.index("--num-layers") + 1] = "4"
    trainer = Trainer(parse_args(flags + ["--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"]))
    in_fp8 = {layer.index for layer in trainer.model.module.decoder.layers
              if all(getattr(m, "fp8", None) is not None for n, m in layer.named_modules() if n.endswith("linear_qkv"))}
    assert in_fp8 == {1}  # layer 0 (first 1) and layers 2, 3 (last 2) stay in bf16
    assert all(torch.isfinite(torch.tensor(losses_of(trainer, 2))))
    everything = Trainer(parse_args(flags))
    assert all(m.fp8 is not None for n, m in everything.model.named_modules() if n.endswith(fp8.LAYERS))
    with pytest.raises(ConfigError, match="--first-last-layers-bf16 has no effect without --fp8-format"):
        parse_args([f for f in flags if f not in ("--fp8-format", "hybrid")] + ["--first-last-layers-bf16"])
    with pytest.raises(ConfigError, match="must together be at most --num-layers 4"):
        parse_args(flags + ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3",
                            "--num-layers-at-end-in-bf16", "2"])


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_bf16(monkeypatch):
    """--no-fp8-wgrad (--disable-fp8-wgrad; Megatron's fp8_wgrad=False): the weight gradient is the bf16
    g^T x exactly, the input gradient the same FP8 one as without the flag; the model takes the per-layer
    path (no fused FP8 MLP) and trains; without --fp8-format the flag is a one-line error."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.fp8 import mlp as fp8_mlp
    from paratron.train.loop import Trainer
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, dtype=torch.bfloat16)
    w = (torch.randn(48, 32) * 0.1).to(torch.bfloat16)
    g = torch.randn(4, 8, 48, dtype=torch.bfloat16)
    grads = []
    for wgrad in (True, False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        state = FP8State(Recipe(emulate=True, fp8_wgrad=wgrad))
        fp8.fp8_linear(xr, wr, state).backward(g)
        grads.append((xr.grad, wr.grad))
    assert torch.equal(grads[0][0], grads[1][0])  # input gradient: FP8 either way
    exact = (g.reshape(-1, 48).t() @ x.reshape(-1, 32)).to(torch.bfloat16)
    assert torch.equal(grads[1][1], exact) and not torch.equal(grads[0][1], exact)
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = TINY + ["--train-iters", "2", "--bf16", "--fp8-format", "hybrid", "--device", "cpu", "--swiglu"]
    for spelling in ("--no-fp8-wgrad", "--disable-fp8-wgrad"):
        trainer = Trainer(parse_args(flags + [spelling]))
        layer = trainer.model.module.decoder.layers[0].mlp
        assert layer.linear_fc1.fp8.recipe.fp8_wgrad is False
        assert not fp8_mlp.applies(layer.linear_fc1, layer.linear_fc2, fp8_mlp.SWIGLU)
        assert all(torch.isfinite(torch.tensor(losses_of(trainer, 2))))
    default = Trainer(parse_args(flags)).model.module.decoder.layers[0].mlp
    assert fp8_mlp.applies(default.linear_fc1, default.linear_fc2, fp8_mlp.SWIGLU)
    with pytest.raises(ConfigError, match="--no-fp8-wgrad has no effect without --fp8-format"):
        parse_args([f for f in flags if f not in ("--fp8-format", "hybrid")] + ["--no-fp8-wgrad"])


@pytest.mark.parametrize("flags,message", [
    (["--fp8-interval", "2"], "--fp8-interval 2: paratron honours only 1"),
    (["--fp8-output-proj"], "MXFP8"),
    (["--keep-fp8-transpose-cache"], "Megatron-FSDP"),
    (["--fp8-quantizer-factory", "x"], "custom quantizer"),
])
def test_megatron_fp8_flags_refused_with_their_reason(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*BASE, *flags])
    assert parse_args([*BASE, "--fp8-interval", "1"]).train.fp8_format is None  # Megatron's default, accepted
