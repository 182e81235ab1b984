"""The routed experts' fused FP8 MLP (paratron/fp8/experts_mlp.py) on CPU, by emulation: the whole function
against the per-layer FP8 experts (fp8/experts.py, checked by hand in test_fp8_experts.py) with fc1, SwiGLU and
fc2 applied one by one, forward and every gradient; the delayed recipe's histories; the blockwise recipe's fused
function against the per-layer path and a plain fp32 reference; where the MoE layer takes it; a tiny blockwise MoE
GPT trained through it and GEMM by GEMM. The Triton kernels behind its ops are checked on the GPU
(tests/gpu/test_fp8_moe_cuda.py)."""
import pytest
import torch

from paratron import fp8
from paratron.fp8 import FP8State, Recipe
from paratron.fp8 import experts_mlp
from paratron.fp8.experts import fp8_grouped_mm
from paratron.fp8.mlp import GELU, SWIGLU
from paratron.model.moe import aligned_rows


def _case(counts, hidden, ffn, seed=0, align=16):
    torch.manual_seed(seed)
    counts_t = torch.tensor(counts)
    expert_index = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    dest, ends, size = aligned_rows(counts_t, expert_index, align)
    ends = torch.cat([ends[:-1], ends.new_full((1,), size)])  # the last group over the rows past it (zero)
    x = torch.randn(int(counts_t.sum()), hidden)
    padded = x.new_zeros(size, hidden).index_copy(0, dest, x)
    w1 = torch.randn(len(counts), 2 * ffn, hidden) * 0.2
    w2 = torch.randn(len(counts), hidden, ffn) * 0.2
    g = torch.randn(size, hidden)
    return padded, w1, w2, g, ends


def _run(fn, x, w1, w2, g):
    x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = fn(x, w1, w2)
    y.backward(g)
    return y.detach(), x.grad, w1.grad, w2.grad


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_experts_mlp_equals_fc1_swiglu_fc2_one_by_one(recipe):
    x, w1, w2, g, ends = _case([5, 0, 19, 8], 32, 48)
    r = Recipe(format="e4m3", recipe=recipe, amax_history_len=4, emulate=True)
    s1, s2, p1, p2 = (FP8State(r) for _ in range(4))

    def fused(x, w1, w2):
        return experts_mlp.fused_experts_mlp(x, w1, w2, ends, s1, s2, SWIGLU)

    def per_layer(x, w1, w2):
        gate, up = fp8_grouped_mm(x, w1, ends, p1).chunk(2, dim=-1)
        return fp8_grouped_mm(torch.nn.functional.silu(gate) * up, w2, ends, p2)

    for _ in range(2):  # (delayed: the second step scales from the histories the first recorded)
        got, want = _run(fused, x, w1, w2, g), _run(per_layer, x, w1, w2, g)
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-5
        assert 0 < _rel(got[0], _per_expert(x, w1, w2, ends)) < 0.1  # FP8, not the exact product
    if recipe == "delayed":
        for a, b in zip((s1.input, s1.weight, s1.grad, s2.input, s2.weight, s2.grad),
                        (p1.input, p1.weight, p1.grad, p2.input, p2.weight, p2.grad)):
            assert torch.allclose(a.history, b.history, rtol=1e-6) and a.history[1] > 0


def _per_expert(x, w1, w2, ends):
    """The exact (unquantised) expert MLP, group by group."""
    out, start = torch.zeros(x.shape[0], w2.shape[1]), 0
    for e, end in enumerate(ends.tolist()):
        gate, up = (x[start:end] @ w1[e].t()).chunk(2, dim=-1)
        out[start:end] = (torch.nn.functional.silu(gate) * up) @ w2[e].t()
        start = end
    return out


def test_where_the_fused_experts_mlp_applies():
    def states(**kw):
        r = Recipe(**{"format": "e4m3", "recipe": "tensorwise", **kw})
        return FP8State(r), FP8State(r)
    assert experts_mlp.applies(*states(emulate=True), SWIGLU, False)
    assert experts_mlp.applies(*states(grouped_gemm="scaled_grouped_mm"), SWIGLU, False)
    assert experts_mlp.applies(*states(recipe="delayed", grouped_gemm="scaled_grouped_mm"), SWIGLU, False)
    # torch's grouped FP8 GEMM takes no e5m2 gradient: hybrid keeps the per-layer path (its bf16 backward)
    assert not experts_mlp.applies(*states(format="hybrid", grouped_gemm="scaled_grouped_mm"), SWIGLU, False)
    assert not experts_mlp.applies(*states(emulate=True, fp8_wgrad=False), SWIGLU, False)
    assert not experts_mlp.applies(*states(emulate=True, fuse_mlp=False), SWIGLU, False)
    assert not experts_mlp.applies(*states(emulate=True), None, False)  # an activation without a fused kernel
    assert not experts_mlp.applies(*states(emulate=True), SWIGLU, True)  # expert biases
    s1, _ = states(emulate=True)
    assert not experts_mlp.applies(s1, FP8State(Recipe(format="e4m3", recipe="delayed", emulate=True)), SWIGLU, False)
    assert not experts_mlp.applies(s1, None, SWIGLU, False)


@pytest.mark.parametrize("fused", [True, False])
def test_moe_layer_takes_the_fused_fp8_experts_mlp(monkeypatch, fused):
    """The MoE layer with e4m3 states on its experts runs them through the fused function (--kernel-fp8-fused-mlp
    on), with and without --moe-permute-fusion, and gives the per-layer path's outputs and gradients."""
    from paratron.model.layers import Parallel
    from paratron.model.moe import MoELayer
    from paratron.train.resolve import parse_args
    calls = []
    real = experts_mlp.fused_experts_mlp
    monkeypatch.setattr(experts_mlp, "fused_experts_mlp", lambda *a: calls.append(1) or real(*a))
    results = []
    for fuse_mlp in (True, False):
        args = ["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--num-layers", "1", "--hidden-size", "32",
                "--num-attention-heads", "2", "--seq-length", "16", "--num-experts", "4", "--moe-router-topk", "2",
                "--moe-ffn-hidden-size", "48", "--swiglu", "--disable-bias-linear", "--moe-grouped-gemm"]
        cfg = parse_args(args + (["--moe-permute-fusion"] if fused else [])).model
        torch.manual_seed(0)
        layer = MoELayer(cfg, Parallel())
        fp8.attach(layer, Recipe(format="e4m3", recipe="tensorwise", emulate=True, fuse_mlp=fuse_mlp))
        x = torch.randn(16, 2, 32, requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, layer.experts.linear_fc1.weight.grad,
                        layer.experts.linear_fc2.weight.grad))
        assert layer.experts.fused_fp8() == fuse_mlp
    assert len(calls) == 1
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fused_experts_mlp_compiles_on_cpu(recipe):
    """Under torch.compile (a CPU run's --torch-compile) the emulated grouped GEMMs are an operator of their own:
    torch's meta function of ``_grouped_mm`` takes bf16 only, and a CPU run's FP8 experts stopped there. Compiled =
    eager, output and gradients (blockwise: traced whole, the SwiGLU tile ops by their fake functions)."""
    x, w1, w2, g, ends = _block_case(torch.bfloat16) if recipe == "blockwise" else _case([5, 0, 19, 8], 32, 48)
    r = Recipe(format="e4m3", recipe=recipe, emulate=True)
    compiled = torch.compile(experts_mlp.fused_experts_mlp, backend="aot_eager", fullgraph=recipe == "blockwise",
                             dynamic=False)  # (static shapes: a second case of other shapes is traced afresh)
    runs = [_run(lambda x, w1, w2: fn(x, w1, w2, ends, FP8State(r), FP8State(r), SWIGLU), x, w1, w2, g)
            for fn in (experts_mlp.fused_experts_mlp, compiled)]
    for a, b in zip(*runs):
        assert _rel(a.float(), b.float()) < 1e-6


def test_startup_line_says_how_the_experts_run():
    """The start-up line names the layers whose experts take the fused FP8 MLP and, for the others, why not."""
    from paratron.fp8.linear import experts_paths
    from paratron.model.layers import Parallel
    from paratron.model.moe import MoELayer
    from paratron.train.resolve import parse_args
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--num-layers", "1", "--hidden-size", "32",
                      "--num-attention-heads", "2", "--seq-length", "16", "--num-experts", "4",
                      "--moe-ffn-hidden-size", "48", "--swiglu", "--disable-bias-linear", "--moe-grouped-gemm"]).model
    layers = [MoELayer(cfg, Parallel()) for _ in range(3)]
    assert experts_paths(layers) == ""  # no FP8
    for layer, kw in zip(layers, [{}, {"fuse_mlp": False}, {"format": "hybrid", "grouped_gemm": "scaled_grouped_mm"}]):
        fp8.attach(layer, Recipe(**{"format": "e4m3", "recipe": "delayed", "emulate": "grouped_gemm" not in kw, **kw}))
    want = "; routed experts: 1 as the fused FP8 MLP, 2 GEMM by GEMM (--kernel-fp8-fused-mlp off)"
    assert experts_paths(layers) == want
    assert layers[2].experts.fp8_path() == "hybrid: torch's grouped FP8 GEMM takes no e5m2 gradient"
    layers[0].experts.recompute_act = True
    assert layers[0].experts.fp8_path() == "--recompute-modules moe_act" and not layers[0].experts.fused_fp8()


def _block_case(dtype):
    """Rows of four experts (one without rows) in the grouped layout at blockwise's alignment (each expert's rows
    start at a multiple of 128), hidden 256, FFN 128, in ``dtype``."""
    x, w1, w2, g, ends = _case([100, 0, 190, 30], 256, 128, seed=3, align=128)
    return x.to(dtype), (w1 * 0.25).to(dtype), (w2 * 0.25).to(dtype), g.to(dtype), ends


def _block_states():
    return [FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True)) for _ in range(2)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2.5e-2)])
def test_blockwise_fused_experts_mlp_equals_the_per_layer_path(dtype, tol):
    """The blockwise fused experts MLP against fc1, SwiGLU and fc2 one by one through fp8/experts.py (same rows,
    weights and recipe): output and every gradient. In fp32 the two quantise the same SwiGLU values, so they agree
    to fp32 rounding. In bf16 the per-layer path rounds the SwiGLU's output and its gradient to bf16 before casting
    them to e4m3 tiles, where the fused kernels cast the fp32 values: different e4m3 codes where the bf16 rounding
    crosses a rounding boundary, so the dense block MLP's tolerance (test_fp8_block_mlp.py, 2.5 %) applies."""
    x, w1, w2, g, ends = _block_case(dtype)
    s1, s2 = _block_states()
    p1, p2 = _block_states()
    for s in (s1, s2, p1, p2):
        s.trace = []

    def fused(x, w1, w2):
        return experts_mlp.fused_experts_mlp(x, w1, w2, ends, s1, s2, SWIGLU)

    def per_layer(x, w1, w2):
        gate, up = fp8_grouped_mm(x, w1, ends, p1).chunk(2, dim=-1)
        return fp8_grouped_mm(torch.nn.functional.silu(gate) * up, w2, ends, p2)

    got, want = _run(fused, x, w1, w2, g), _run(per_layer, x, w1, w2, g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype and b.float().norm() > 0
        assert _rel(a.float(), b.float()) < tol
    assert not got[2][1].any() and not got[3][1].any()  # the expert without rows: zero weight gradients
    assert s1.trace == p1.trace and s2.trace == p2.trace  # the same roles quantised (input, weight, grad)


def test_blockwise_fused_experts_mlp_is_close_to_fp32():
    """Against the plain fp32 experts (no quantisation, autograd's gradients), within FP8's error (e4m3 keeps three
    mantissa bits: a few percent over the GEMMs), and not equal to it (the recipe quantises)."""
    x, w1, w2, g, ends = _block_case(torch.float32)
    s1, s2 = _block_states()
    got = _run(lambda x, w1, w2: experts_mlp.fused_experts_mlp(x, w1, w2, ends, s1, s2, SWIGLU), x, w1, w2, g)
    want = _run(lambda x, w1, w2: _per_expert(x, w1, w2, ends), x, w1, w2, g)
    for name, a, b in zip(("y", "x", "w1", "w2"), got, want):
        assert 0 < _rel(a, b) < 0.1, name  # (6.5 % seen on every tensor: products of two quantised operands)


def test_where_the_blockwise_fused_experts_mlp_applies():
    """Blockwise SwiGLU without biases, FP8 weight gradients and the fused MLP on: None; else the reason, named."""
    def states(**kw):
        r = Recipe(**{"format": "e4m3", "recipe": "blockwise", "emulate": True, **kw})
        return FP8State(r), FP8State(r)
    why = experts_mlp.why_not
    assert why(*states(), SWIGLU, False) is None
    assert why(*states(block_grouped_gemm="deepgemm"), SWIGLU, False) is None
    assert why(*states(format="hybrid"), SWIGLU, False) == "hybrid: the blockwise recipe takes e4m3 only"
    assert why(*states(), SWIGLU, True) == "expert biases"
    assert why(*states(fp8_wgrad=False), SWIGLU, False) == "--no-fp8-wgrad"
    assert why(*states(fuse_mlp=False), SWIGLU, False) == "--kernel-fp8-fused-mlp off"
    assert why(*states(), GELU, False) == "the blockwise recipe with an activation other than SwiGLU"
    assert why(*states(), None, False) == "an activation without a fused FP8 kernel"
    tensorwise = FP8State(Recipe(format="e4m3", recipe="tensorwise", emulate=True))
    assert why(states()[0], tensorwise, SWIGLU, False) == "fc1 and fc2 in different precisions or recipes"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_blockwise_moe_gpt_trains_through_the_fused_experts_mlp(monkeypatch, bf16):
    """A tiny MoE GPT under --fp8-recipe blockwise --fp8-format e4m3, three steps on CPU through the fused experts
    MLP and with --kernel-fp8-fused-mlp off: the fused function called only in the first, the start-up line saying
    which path ran, close losses. fp32 weights: both quantise the same SwiGLU values, so the first two losses agree
    to fp32 rounding (a wrong expert weight gradient moves the second by 2e-5 or more), the third within Adam's
    amplification of fp32 rounding. bf16: the losses differ by the SwiGLU's bf16 rounding before the per-layer
    path's cast (0.4 % seen at the third step)."""
    from paratron.fp8.linear import experts_paths
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_train import losses_of
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    calls = []
    real = experts_mlp._BlockExpertsMLP.apply
    monkeypatch.setattr(experts_mlp._BlockExpertsMLP, "apply", lambda *a: calls.append(1) or real(*a))
    flags = ["--mock-data", "--train-iters", "3", "--lr", "1e-2", "--micro-batch-size", "2", "--device", "cpu",
             "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "64",
             "--vocab-size", "256", "--tokenizer-type", "NullTokenizer", "--global-batch-size", "2", "--swiglu",
             "--disable-bias-linear", "--ffn-hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "128", "--moe-grouped-gemm", "--fp8-format", "e4m3", "--fp8-recipe",
             "blockwise", "--seed", "3", "--num-workers", "0"] + (["--bf16"] if bf16 else [])
    runs, lines = [], []
    for fused in ("on", "off"):
        torch.manual_seed(0)
        trainer = Trainer(parse_args(flags + ["--kernel-fp8-fused-mlp", fused]))
        lines.append(experts_paths(trainer.models))
        n = len(calls)
        runs.append(losses_of(trainer, 3))
        assert (len(calls) > n) == (fused == "on")
    assert lines == ["; routed experts: 2 as the fused FP8 MLP",
                     "; routed experts: 2 GEMM by GEMM (--kernel-fp8-fused-mlp off)"]
    assert runs[0][-1] < runs[0][0]  # it learns
    far = [abs(a - b) / b for a, b in zip(*runs)]
    assert (max(far) < 1e-2) if bf16 else (max(far[:2]) < 1e-6 and far[2] < 1e-3), runs
