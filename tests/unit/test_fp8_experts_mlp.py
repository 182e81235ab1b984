"""The routed experts' fused FP8 MLP (paratron/fp8/experts_mlp.py) on CPU, by emulation: the whole function
against the per-layer FP8 experts (fp8/experts.py, checked by hand in test_fp8_experts.py) with fc1, SwiGLU and
fc2 applied one by one, forward and every gradient; the delayed recipe's histories; where the MoE layer takes it.
The Triton kernels behind its ops are checked on the GPU (tests/gpu/test_fp8_moe_cuda.py)."""
import pytest
import torch

from paratron import fp8
from paratron.fp8 import FP8State, Recipe
from paratron.fp8 import experts_mlp
from paratron.fp8.experts import fp8_grouped_mm
from paratron.fp8.mlp import SWIGLU
from paratron.model.moe import aligned_rows


def _case(counts, hidden, ffn, seed=0):
    torch.manual_seed(seed)
    counts_t = torch.tensor(counts)
    expert_index = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    dest, ends, size = aligned_rows(counts_t, expert_index, 16)
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
    assert not experts_mlp.applies(*states(emulate=True, recipe="blockwise"), SWIGLU, False)
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


def test_fused_experts_mlp_compiles_on_cpu():
    """Under torch.compile (a CPU run's --torch-compile) the emulated grouped GEMMs are an operator of their own:
    torch's meta function of ``_grouped_mm`` takes bf16 only, and a CPU run's FP8 experts stopped there. Compiled =
    eager, output and gradients."""
    x, w1, w2, g, ends = _case([5, 0, 19, 8], 32, 48)
    r = Recipe(format="e4m3", recipe="tensorwise", emulate=True)
    compiled = torch.compile(experts_mlp.fused_experts_mlp, backend="aot_eager")
    runs = [_run(lambda x, w1, w2: fn(x, w1, w2, ends, FP8State(r), FP8State(r), SWIGLU), x, w1, w2, g)
            for fn in (experts_mlp.fused_experts_mlp, compiled)]
    for a, b in zip(*runs):
        assert _rel(a, b) < 1e-6


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
