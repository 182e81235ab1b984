"""The fused FP8 SwiGLU MLP (paratron/parallel/fp8_mlp.py) on CPU: its two quantising ops against
hand-checkable properties, the whole function against the layer-by-layer FP8 path and bf16, and the
MLP's choice of path. The Triton kernels behind the ops are checked on the GPU (tests/gpu)."""
import pytest
import torch

from paratron.config import parse_args
from paratron.model.layers import MLP, Parallel
from paratron import fp8
from paratron.fp8 import mlp as fp8_mlp
from paratron.fp8 import E4M3, E5M2, FP8State, Recipe


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_act_op_scales_to_its_own_amax_and_transposes():
    torch.manual_seed(0)
    h = torch.randn(48, 2 * 32, dtype=torch.bfloat16)
    none = torch.tensor(0.0)  # no preset scale: the tensor's own amax
    q, qt, scale, current = torch.ops.paratron.mlp_act_fp8(h, None, none, fp8_mlp.SWIGLU, 0)
    gate, up = h.float().chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    assert q.dtype == qt.dtype == E4M3 and q.shape == (48, 32) and qt.shape == (32, 48)
    assert scale.item() == pytest.approx(448.0 / a.abs().max().item(), rel=1e-6)
    assert q.float().abs().max().item() == 448.0  # the largest value lands on e4m3's largest
    assert torch.equal(qt, q.t())
    assert _rel(q.float() / scale, a) < 0.05  # 3 mantissa bits
    assert current.item() == pytest.approx(a.abs().max().item(), rel=1e-6)
    _, _, s2, _ = torch.ops.paratron.mlp_act_fp8(h, None, none, fp8_mlp.SWIGLU, 2)  # the scale / 2**margin
    assert s2.item() == pytest.approx(scale.item() / 4, rel=1e-6)


def test_act_op_with_a_preset_scale_uses_it_and_saturates():
    """The delayed recipe's single pass: the given scale, even where it overflows e4m3 (saturated, no
    NaN), and the current amax for the history."""
    torch.manual_seed(0)
    h = torch.randn(48, 2 * 32, dtype=torch.bfloat16)
    _, _, own, current = torch.ops.paratron.mlp_act_fp8(h, None, torch.tensor(0.0), fp8_mlp.SWIGLU, 0)
    preset = own * 4  # a history whose amax was a quarter of this tensor's
    q, qt, scale, current2 = torch.ops.paratron.mlp_act_fp8(h, None, preset, fp8_mlp.SWIGLU, 3)  # margin: own amax only
    assert scale.item() == preset.item() and current2.item() == current.item()
    assert q.float().abs().max().item() == 448.0 and not q.float().isnan().any()
    assert (q.float().abs() == 448.0).sum() > 1  # several values saturated
    gate, up = h.float().chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    small = a.abs() < 448.0 / preset
    assert _rel(q.float()[small] / scale, a[small]) < 0.05


@pytest.mark.parametrize("e5m2,dtype,fmax", [(True, E5M2, 57344.0), (False, E4M3, 448.0)])
def test_grad_op_matches_autograd_of_swiglu(e5m2, dtype, fmax):
    torch.manual_seed(1)
    h = torch.randn(32, 2 * 16, dtype=torch.float32, requires_grad=True)
    dout = torch.randn(32, 16)
    gate, up = h.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(dout)
    q, qt, scale, current, db = torch.ops.paratron.mlp_act_fp8_backward(h.detach(), None, dout, torch.tensor(0.0),
                                                                        fp8_mlp.SWIGLU, e5m2, 0)
    assert db.numel() == 0  # no bias
    assert q.dtype == dtype and q.shape == (32, 32) and torch.equal(qt, q.t())
    assert scale.item() == pytest.approx(fmax / h.grad.abs().max().item(), rel=1e-6)
    assert current.item() == pytest.approx(h.grad.abs().max().item(), rel=1e-6)
    assert _rel(q.float() / scale, h.grad) < (0.1 if e5m2 else 0.05)
    q2, _, scale2, _, _ = torch.ops.paratron.mlp_act_fp8_backward(h.detach(), None, dout, scale / 2, fp8_mlp.SWIGLU,
                                                                  e5m2, 0)
    assert scale2.item() == scale.item() / 2 and _rel(q2.float() / scale2, h.grad) < (0.1 if e5m2 else 0.05)


@pytest.mark.parametrize("act", [0, 1, 2])
def test_activation_gradient_formulas_match_autograd(act):
    torch.manual_seed(2)
    z = (torch.randn(16, 2 * 24 if act == fp8_mlp.SWIGLU else 24, dtype=torch.float64) * 3).requires_grad_()
    d = torch.randn(16, 24, dtype=torch.float64)
    want, = torch.autograd.grad(fp8_mlp.activation(z, act), z, d)
    assert torch.allclose(fp8_mlp.activation_grad(z.detach(), d, act), want, rtol=1e-10, atol=1e-12)


def test_gelu_ops_with_a_bias():
    """GeLU (exact and tanh) with fc1's bias: the output quantised from gelu(h + b), the gradient
    from its derivative, the bias gradient the column sums of the fp32 gradient."""
    torch.manual_seed(3)
    h = torch.randn(40, 32, dtype=torch.bfloat16)
    b = torch.randn(32, dtype=torch.bfloat16)
    dout = torch.randn(40, 32, dtype=torch.bfloat16)
    none = torch.tensor(0.0)
    for act, approx in ((fp8_mlp.GELU, "none"), (fp8_mlp.GELU_TANH, "tanh")):
        z = h.float() + b.float()
        q, qt, scale, current = torch.ops.paratron.mlp_act_fp8(h, b, none, act, 0)
        a = torch.nn.functional.gelu(z, approximate=approx)
        assert q.shape == (40, 32) and torch.equal(qt, q.t()) and current.item() == pytest.approx(a.abs().max().item())
        assert _rel(q.float() / scale, a) < 0.05
        zg = z.clone().requires_grad_()
        torch.nn.functional.gelu(zg, approximate=approx).backward(dout.float())
        gq, gqt, gscale, _, db = torch.ops.paratron.mlp_act_fp8_backward(h, b, dout, none, act, True, 0)
        assert gq.shape == (40, 32) and gq.dtype == E5M2 and _rel(gq.float() / gscale, zg.grad) < 0.1
        assert torch.allclose(db, zg.grad.sum(0), rtol=1e-5, atol=1e-5)


def _weights(seed=0, k=64, f=48, n=64):
    torch.manual_seed(seed)
    x = torch.randn(2, 16, k, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(2 * f, k) * 0.05).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(n, f) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(2, 16, n, dtype=torch.bfloat16)
    return x, w1, w2, g


def _run(fn, x, w1, w2, g):
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    y = fn(x, w1, w2)
    y.backward(g)
    return y, x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("emulate", [True, False])
def test_fused_mlp_close_to_layer_by_layer_fp8_and_to_bf16(emulate):
    if not emulate:
        try:
            torch._scaled_mm(torch.zeros(16, 16, dtype=E4M3), torch.zeros(16, 16, dtype=E4M3).t(),
                             torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError):
            pytest.skip("this torch has no CPU torch._scaled_mm for float8")
    recipe = Recipe(emulate=emulate)
    x, w1, w2, g = _weights()
    s = [FP8State(recipe) for _ in range(4)]
    for st in s:
        st.trace = []
    fused = _run(lambda x, a, b: fp8_mlp.fused_mlp(x, a, None, b, s[0], s[1]), x, w1, w2, g)
    def per_layer(x, a, b):
        gate, up = fp8.fp8_linear(x, a, s[2]).chunk(2, dim=-1)
        return fp8.fp8_linear(torch.nn.functional.silu(gate) * up, b, s[3])
    layered = _run(per_layer, x, w1, w2, g)
    exact = _run(lambda x, a, b: fp8_mlp.reference_mlp(x.float(), a.float(), b.float()), x, w1, w2, g)
    for f, l, e in zip(fused, layered, exact):
        assert f.dtype == torch.bfloat16 and f.shape == l.shape
        # same FP8 numbers but for the SwiGLU output / gradient quantised from fp32 instead of bf16
        assert _rel(f, l) < 0.03, _rel(f, l)
        assert _rel(f, e) < 0.15 and _rel(f, e) > 0  # FP8's own error (e5m2 gradients), really quantised
    # every tensor role of both layers was quantised once, in the same formats as per layer
    assert sorted(s[0].trace + s[1].trace) == sorted(s[2].trace + s[3].trace)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fused_mlp_delayed_keeps_the_histories_of_the_layer_by_layer_path(algo):
    """The delayed recipe through the fused function: unprimed (first step: the current amax where the
    history is empty) then primed (scales from the history alone); each step records the same amaxes
    as the per-layer path, the SwiGLU ones up to their bf16 rounding there."""
    recipe = Recipe(recipe="delayed", amax_history_len=4, amax_compute_algo=algo, emulate=True)
    s = [FP8State(recipe) for _ in range(4)]
    def per_layer(x, a, b):
        gate, up = fp8.fp8_linear(x, a, s[2]).chunk(2, dim=-1)
        return fp8.fp8_linear(torch.nn.functional.silu(gate) * up, b, s[3])
    for step in range(3):
        x, w1, w2, g = _weights(seed=step)
        x = x * (step + 1)  # amaxes that change from step to step
        fused = _run(lambda x, a, b: fp8_mlp.fused_mlp(x, a, None, b, s[0], s[1]), x, w1, w2, g)
        layered = _run(per_layer, x, w1, w2, g)
        for f, l in zip(fused, layered):
            assert _rel(f, l) < 0.03, (step, _rel(f, l))
        for a, b in zip(s[0].scalers + s[1].scalers, s[2].scalers + s[3].scalers):
            assert torch.allclose(a.history, b.history, rtol=1e-2), (step, a.history, b.history)
            assert a.history[step + 1:].eq(0).all() and a.history[:step + 1].gt(0).all()
        fp8.prime(s)
    assert all(sc.primed for st in s for sc in st.scalers)


def _mlp(flags, recipe):
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                      "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--mock-data", "--train-iters", "1",
                      "--lr", "1e-3", "--micro-batch-size", "2", "--device", "cpu", *flags]).model
    mlp = MLP(cfg, Parallel(), dtype=torch.bfloat16)
    mlp.linear_fc1.fp8, mlp.linear_fc2.fp8 = FP8State(recipe), FP8State(recipe)
    return mlp


@pytest.mark.parametrize("flags,recipe,fused", [
    (["--swiglu", "--disable-bias-linear"], Recipe(emulate=True), True),
    (["--swiglu", "--disable-bias-linear"], Recipe(emulate=True, fuse_mlp=False), False),
    (["--swiglu", "--disable-bias-linear"], Recipe(recipe="delayed", emulate=True), True),
    (["--swiglu"], Recipe(emulate=True), True),  # biases: fc1's in the kernels, fc2's added after
    (["--swiglu", "--disable-bias-linear", "--no-bias-swiglu-fusion"], Recipe(emulate=True), False),
    (["--disable-bias-linear"], Recipe(emulate=True), True),  # GeLU
    ([], Recipe(emulate=True), True),  # GeLU with biases (GPT)
    (["--openai-gelu"], Recipe(recipe="delayed", emulate=True), True),
    (["--no-bias-gelu-fusion"], Recipe(emulate=True), False),
    (["--squared-relu"], Recipe(emulate=True), False),
    (["--quick-geglu"], Recipe(emulate=True), False),
])
def test_mlp_takes_the_fused_path_only_where_it_applies(monkeypatch, flags, recipe, fused):
    calls = []
    real = fp8_mlp.fused_mlp
    monkeypatch.setattr(fp8_mlp, "fused_mlp", lambda *a: calls.append(1) or real(*a))
    mlp = _mlp(flags, recipe)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    out = mlp(x, res)
    out.float().sum().backward()
    assert bool(calls) == fused
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in mlp.parameters())


def test_switch_from_the_config(monkeypatch):
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = ["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "2", "--bf16",
             "--fp8-format", "hybrid"]
    cfg = parse_args(flags)
    assert Recipe.from_config(cfg.train, cfg.kernels).fuse_mlp
    cfg = parse_args(flags + ["--kernel-fp8-fused-mlp", "off"])
    assert not Recipe.from_config(cfg.train, cfg.kernels).fuse_mlp


def test_compiled_delayed_recipe_equals_eager_and_recompiles_once_when_primed():
    """The delayed recipe traced into a compiled region (AOTAutograd's graphs, run by aot_eager): the
    history updates of the forward and of the backward happen as in eager mode, for the fused MLP and
    a per-layer linear; priming specialises the graph once more (scales from the history alone)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    recipe = Recipe(recipe="delayed", amax_history_len=4, amax_compute_algo="max", emulate=True)
    eager_states, compiled_states = ([FP8State(recipe, "cpu") for _ in range(3)] for _ in range(2))

    def block(x, w1, w2, w3, s):
        return fp8.fp8_linear(fp8_mlp.fused_mlp(x, w1, None, w2, s[0], s[1]), w3, s[2])

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for step in range(4):
        x, w1, w2, g = _weights(seed=step)
        w3 = (torch.randn(64, 64) * 0.05).to(torch.bfloat16).requires_grad_()
        want = _run(lambda x, a, b: block(x * (step + 1), a, b, w3, eager_states), x, w1, w2, g)
        got = _run(lambda x, a, b: compiled(x * (step + 1), a, b, w3, compiled_states), x, w1, w2, g)
        for a, b in zip(want, got):
            assert torch.equal(a, b), step
        for a, b in zip(*(sum((st.scalers for st in s), ()) for s in (eager_states, compiled_states))):
            assert torch.equal(a.history, b.history) and a.history[step].gt(0)
        fp8.prime(eager_states + compiled_states)
    assert counter.frame_count == 2


@pytest.mark.parametrize("act", [1, 2])
def test_fused_gelu_mlp_with_bias_close_to_layer_by_layer_fp8(act):
    """GeLU with fc1's bias through the fused function against fp8_linear + bias + GeLU + fp8_linear:
    outputs and every gradient, the bias's included, within FP8's rounding of the one tensor quantised
    differently (the GeLU output / gradient from fp32 instead of bf16)."""
    approx = "tanh" if act == fp8_mlp.GELU_TANH else "none"
    torch.manual_seed(5)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    w1 = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    b1 = (torch.randn(96) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(64, 96) * 0.05).to(torch.bfloat16)
    g = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    s = [FP8State(Recipe(emulate=True)) for _ in range(4)]

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
        y = fn(*leaves)
        y.backward(g)
        return [y] + [t.grad for t in leaves]

    fused = run(lambda x, w1, b1, w2: fp8_mlp.fused_mlp(x, w1, b1, w2, s[0], s[1], act))
    layered = run(lambda x, w1, b1, w2: fp8.fp8_linear(
        torch.nn.functional.gelu(fp8.fp8_linear(x, w1, s[2]) + b1, approximate=approx), w2, s[3]))
    exact = run(lambda x, w1, b1, w2: fp8_mlp.reference_mlp(x.float(), w1.float(), w2.float(), b1.float(), act))
    for f, l, e in zip(fused, layered, exact):
        assert f.dtype == torch.bfloat16 and f.shape == l.shape
        assert _rel(f, l) < 0.03, _rel(f, l)
        assert 0 < _rel(f, e) < 0.15
