"""FP8 for the routed experts (paratron/fp8/experts.py, kernels/fp8_grouped.py) on CPU, by emulation
(quantise -> dequantise -> fp32 grouped matmul): the three grouped GEMMs against per-expert products
written out by hand for the tensorwise, delayed and blockwise recipes, the padding rows, --no-fp8-wgrad,
and the MoE layer with FP8 states attached against the bf16 layer."""
import pytest
import torch

from paratron import fp8
from paratron.fp8 import E4M3, E5M2, FP8State, Recipe
from paratron.fp8.experts import fp8_grouped_mm
from paratron.kernels import fp8_block as fb
from paratron.model.moe import aligned_rows


def _deq_tensor(t, dtype):
    s = fp8.compute_scale(fp8.amax(t), fp8.FMAX[dtype])
    return fp8.dequantize(fp8.quantize(t, s, dtype), s)


def _case(counts, k, n, align, seed=0):
    torch.manual_seed(seed)
    counts_t = torch.tensor(counts)
    expert_index = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    dest, ends, size = aligned_rows(counts_t, expert_index, align)
    rows = int(counts_t.sum())
    x = torch.randn(rows, k)
    padded = x.new_zeros(size, k).index_copy(0, dest, x).requires_grad_()
    w = (torch.randn(len(counts), n, k) * 0.1).requires_grad_()
    g = torch.randn(size, n)
    return padded, w, g, dest, ends


def _groups(ends):
    starts = [0] + ends.tolist()[:-1]
    return list(zip(starts, ends.tolist()))


@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "hybrid"), ("delayed", "e4m3")])
def test_tensor_scaled_grouped_gemms_by_hand(recipe, fmt):
    x, w, g, dest, ends = _case([3, 0, 5], 32, 48, 16)
    state = FP8State(Recipe(format=fmt, recipe=recipe, emulate=True))
    y = fp8_grouped_mm(x, w, ends, state)
    y.backward(g)
    gdt = E5M2 if fmt == "hybrid" else E4M3
    xd, wd, gd = _deq_tensor(x.detach(), E4M3), _deq_tensor(w.detach(), E4M3), _deq_tensor(g, gdt)
    for e, (a, b) in enumerate(_groups(ends)):
        assert torch.allclose(y[a:b], xd[a:b] @ wd[e].t(), atol=1e-5)
        assert torch.allclose(x.grad[a:b], gd[a:b] @ wd[e], atol=1e-5)
        assert torch.allclose(w.grad[e], gd[a:b].t() @ xd[a:b], atol=1e-4)
    pad = torch.ones(int(ends[-1]), dtype=torch.bool)  # rows past the last group are never read
    pad[dest] = False
    assert (y[:int(ends[-1])][pad] == 0).all() and pad.any()  # padding rows inside the groups come back zero
    if recipe == "delayed":  # the amaxes went into the experts' histories
        assert state.input.history[0].item() == x.detach().abs().max().item()
        assert state.grad.history[0].item() == g.abs().max().item()


def test_blockwise_grouped_gemms_by_hand():
    """Rows in 1 x 128 tiles along K (forward) and along the tokens (weight gradient: each expert's rows start
    at a multiple of 128, so no tile holds two experts); each expert's weight in 128 x 128 blocks."""
    x, w, g, dest, ends = _case([130, 20], 128, 256, 128)
    state = FP8State(Recipe(format="e4m3", recipe="blockwise", emulate=True))
    y = fp8_grouped_mm(x, w, ends, state)
    y.backward(g)
    assert ends.tolist() == [256, 384]
    tiles = lambda t: fb.dequantize_tiles(*fb.quantize_tiles(t))  # noqa: E731
    xd, gd = tiles(x.detach()), tiles(g)
    gtd, xtd = tiles(g.t()).t(), tiles(x.detach().t()).t()  # along the tokens
    for e, (a, b) in enumerate(_groups(ends)):
        wd = fb.dequantize_blocks(*fb.quantize_blocks(w.detach()[e]))
        assert torch.allclose(y[a:b], xd[a:b] @ wd.t(), atol=1e-5)
        assert torch.allclose(x.grad[a:b], gd[a:b] @ wd, atol=1e-5)
        assert torch.allclose(w.grad[e], gtd[a:b].t() @ xtd[a:b], atol=1e-4)
    exact = g[:256].t() @ x.detach()[:256]
    assert (w.grad[0] - exact).norm() / exact.norm() < 0.05


def test_no_fp8_wgrad_gives_the_exact_expert_weight_gradient():
    """--no-fp8-wgrad: the weight gradient from the bf16 rows and output gradient; the input gradient from the output
    gradient quantised once, row-major (no transposed copy: nothing reads it)."""
    x, w, g, _, ends = _case([16, 16], 32, 32, 16)
    state = FP8State(Recipe(emulate=True, fp8_wgrad=False, format="e4m3"))

    def both(t):
        raise AssertionError("a transposed FP8 copy of the output gradient was made")
    state.grad.quantize_both = both
    fp8_grouped_mm(x, w, ends, state).backward(g)
    for e, (a, b) in enumerate(_groups(ends)):
        assert torch.allclose(w.grad[e], g[a:b].t() @ x.detach()[a:b], atol=1e-5)
    gd, wd = _deq_tensor(g, E4M3), _deq_tensor(w.detach(), E4M3)  # (one scale for all experts' weights)
    for e, (a, b) in enumerate(_groups(ends)):
        assert torch.allclose(x.grad[a:b], gd[a:b] @ wd[e], atol=1e-5)


def test_dequant_path_equals_emulation_within_bf16():
    x, w, g, _, ends = _case([20, 12], 32, 48, 16)
    out = {}
    for emulate in (True, False):
        state = FP8State(Recipe(emulate=emulate, grouped_gemm="dequant"))
        out[emulate] = fp8_grouped_mm(x.detach().bfloat16(), w.detach().bfloat16(), ends, state).float()
    end = int(ends[-1])  # rows past the last group are never written
    assert torch.allclose(out[False][:end], out[True][:end], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_dequant_path_compiled_gives_eager_gradients(recipe):
    """The experts' FP8 function traced by torch.compile's autograd (aot_eager: no code generation) gives the eager
    gradients. Under torch 2.11 (the GPU machine's) a forward that returned ``out.to(out.dtype)`` (``out`` itself)
    was traced with a zero output gradient: both gradients zero, moe-mini did not learn under the compiled blockwise
    recipe; ``kernels.fp8_grouped.as_dtype`` avoids it."""
    x, w, g, _, ends = _case([256, 0, 128], 128, 128, 128)
    grads = []
    for compiled in (False, True):
        state = FP8State(Recipe(format="e4m3", recipe=recipe, grouped_gemm="dequant"))
        xi, wi = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
        fn = torch.compile(fp8_grouped_mm, backend="aot_eager") if compiled else fp8_grouped_mm
        (fn(xi, wi, ends, state).float() * g).sum().backward()
        grads.append((xi.grad.float()[:int(ends[-1])], wi.grad.float()))  # (rows past the last group: unwritten)
    for eager, traced in zip(*grads):
        assert eager.norm() > 0 and torch.equal(traced, eager)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_no_fp8_expert_path_converts_a_tensor_to_its_own_dtype(monkeypatch, fmt):
    """torch 2.11's compiler traced an autograd function whose forward returned ``out.to(out.dtype)`` with a zero
    output gradient (test above); this CPU torch no longer does, so the rule itself is checked: on the path of
    torch's grouped FP8 GEMM (a stand-in here: it writes bf16, as torch's does), forward and backward, no ``.to``
    names the dtype its tensor already has. (A bf16 model once took ``.to(torch.bfloat16)`` of torch's bf16 result
    and moe-mini's FP8 experts stopped learning under --torch-compile on an H100.)"""
    from torch.overrides import TorchFunctionMode

    def scaled_grouped_mm(a, b, sa, sb, offs=None, out_dtype=None, use_fast_accum=False):
        return torch._grouped_mm(a.float(), b.float(), offs=offs).to(out_dtype)

    class SameDtype(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and args[1:2] and args[1] == args[0].dtype:
                self.found.append(args[0].dtype)
            return func(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)
    x, w, g, _, ends = _case([32, 0, 16], 32, 48, 16)
    xi, wi = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    state = FP8State(Recipe(format=fmt, grouped_gemm="scaled_grouped_mm"))
    with SameDtype() as mode:
        fp8_grouped_mm(xi, wi, ends, state).backward(g.bfloat16())
    assert xi.grad is not None and wi.grad.float().norm() > 0
    assert mode.found == []


def test_dequant_wgrad_of_an_expert_without_rows_is_zero_whatever_the_kernel_leaves(monkeypatch):
    """An expert that gets no tokens (an empty group along the summed dimension) has a zero weight gradient on
    the dequant path even when the grouped GEMM leaves that group's output unwritten: a stand-in kernel fills it
    with NaN, as uninitialised memory may hold; the operands reach the kernel in torch's weight-gradient layout."""
    from paratron.kernels import fp8_grouped
    real = torch._grouped_mm

    layouts = []

    def leaves_empty_groups(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:
            layouts.append((a.stride(0) == 1, b.stride(1) == 1))
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", leaves_empty_groups)
    x, w, g, _, ends = _case([130, 0, 20], 128, 256, 128)
    gt, sg = fb.quantize_tiles(g.t().bfloat16())
    xt, sx = fb.quantize_tiles(x.detach().t().bfloat16())
    got = fp8_grouped.grouped_wgrad(gt, sg, xt, sx, ends, "block", torch.bfloat16, "dequant")
    assert (got[1] == 0).all()
    assert layouts == [(True, True)]  # g^T column-major, x row-major: torch's own weight-gradient layout
    want = fp8_grouped.grouped_wgrad(gt, sg, xt, sx, ends, "block", torch.float32, "emulate")
    for e in (0, 2):  # (bf16 products against fp32)
        assert (got[e].float() - want[e]).norm() / want[e].norm() < 1e-2


@pytest.mark.parametrize("recipe,hidden", [("tensorwise", 32), ("blockwise", 128)])
def test_moe_layer_in_fp8_is_close_to_bf16(recipe, hidden):
    """The MoE layer's routed experts with FP8 states (attach): forward and expert gradients close to the
    same layer without them, and every expert GEMM went through FP8 (the states' traces)."""
    from paratron.model.layers import Parallel
    from paratron.model.moe import MoELayer
    from paratron.train.resolve import parse_args
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--num-layers", "1", "--hidden-size",
                      str(hidden), "--num-attention-heads", "2", "--seq-length", "16", "--num-experts", "4",
                      "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(hidden), "--swiglu",
                      "--disable-bias-linear", "--moe-grouped-gemm"]).model
    torch.manual_seed(0)
    layer = MoELayer(cfg, Parallel())
    x = torch.randn(16, 2, hidden)
    ref = layer(x.clone().requires_grad_())
    ref.square().sum().backward()
    ref_grads = [layer.experts.linear_fc1.weight.grad.clone(), layer.experts.linear_fc2.weight.grad.clone()]
    layer.zero_grad()
    fmt = "e4m3" if recipe == "blockwise" else "hybrid"
    assert fp8.attach(layer, Recipe(format=fmt, recipe=recipe, emulate=True)) == 2
    for m in (layer.experts.linear_fc1, layer.experts.linear_fc2):
        m.fp8.trace = []
    out = layer(x.clone().requires_grad_())
    out.square().sum().backward()
    assert 0 < (out - ref).norm() / ref.norm() < 0.1
    for got, want in zip([layer.experts.linear_fc1.weight.grad, layer.experts.linear_fc2.weight.grad], ref_grads):
        assert 0 < (got - want).norm() / want.norm() < 0.15
    for m in (layer.experts.linear_fc1, layer.experts.linear_fc2):
        assert [r for r, _ in m.fp8.trace] == ["input", "weight", "grad"]


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_hybrid_backward_on_the_grouped_fp8_gemm_keeps_the_gradient_unrounded(fp8_wgrad):
    """torch's grouped FP8 GEMM takes e4m3 only: under hybrid its backward takes "bf16" (the output gradient,
    rows and weight as they are: no FP8 copy is kept for it), checked by hand per expert and through the autograd
    function; the e4m3 format keeps the FP8 GEMM and the emulation stays the emulation."""
    from paratron.fp8 import experts
    from paratron.kernels import fp8_grouped
    assert experts.backward_path(FP8State(Recipe(format="hybrid")), "scaled_grouped_mm") == "bf16"
    assert experts.backward_path(FP8State(Recipe(format="e4m3")), "scaled_grouped_mm") == "scaled_grouped_mm"
    assert experts.backward_path(FP8State(Recipe(format="hybrid", emulate=True)), "emulate") == "emulate"
    x, w, g, _, ends = _case([5, 0, 11], 32, 48, 16)
    x, w = x.detach(), w.detach()
    gx, gw = experts.bf16_grads(g, x, w, ends, (True, True), torch.float32)
    for e, (a, b) in enumerate(_groups(ends)):
        assert torch.allclose(gx[a:b], g[a:b] @ w[e], atol=1e-5)
        assert torch.allclose(gw[e], g[a:b].t() @ x[a:b], atol=1e-4)
    state = FP8State(Recipe(format="hybrid", fp8_wgrad=fp8_wgrad, grouped_gemm="scaled_grouped_mm"))
    real = fp8_grouped.grouped_forward
    try:  # (torch's FP8 grouped GEMM needs Hopper: the forward's product emulated; the backward is the point)
        experts.grouped_forward = lambda *a, **kw: real(*a[:-1], "emulate", **kw)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = experts.fp8_grouped_mm(xr, wr, ends, state)
        y.backward(g)
    finally:
        experts.grouped_forward = real
    xd, wd = _deq_tensor(x, E4M3), _deq_tensor(w, E4M3)
    for e, (a, b) in enumerate(_groups(ends)):  # the forward in FP8
        assert torch.allclose(y[a:b], xd[a:b] @ wd[e].t(), atol=1e-5)
    end = int(ends[-1])  # (rows past the last group: no expert's, never read back)
    assert torch.equal(xr.grad[:end], gx[:end]) and torch.equal(wr.grad, gw)  # the unquantised operands' gradients
