"""The MoE dispatch without host synchronisation (issue 46) on CPU: --moe-permute-fusion's fused gather /
scatter-add against the separate permutation (same tokens to the same experts, same outputs and gradients,
in bf16 and FP8), its one-graph compilation, a count of host reads in the MoE layer's forward and backward
(0 on the dropless grouped path; the counter sees the reads of the paths that have them), and the shared
expert computed while the dispatch all-to-all is in flight (--moe-shared-expert-overlap)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from paratron.config import ModelConfig
from paratron.model import moe, moe_experts
from paratron.model.layers import Parallel

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
HOST_READS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "unique"}


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that copy device values to the host (a synchronisation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=16, swiglu=True, moe_grouped_gemm=True, moe_router_dtype="fp32",
                moe_aux_loss_coeff=1e-2)
    return ModelConfig(**{**base, **kw}).resolved()


def _run(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y.float() * torch.arange(y.shape[-1], dtype=torch.float32)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, False)])
def test_fused_permutation_equals_the_separate_one(dtype, bias):
    torch.manual_seed(0)
    layer = moe.MoELayer(_cfg(disable_bias_linear=not bias, moe_permute_fusion=True), Parallel(), dtype=dtype)
    layer.train()
    with torch.no_grad():
        if bias:
            layer.experts.linear_fc1.bias.normal_()
            layer.experts.linear_fc2.bias.normal_()
    x = torch.randn(8, 3, 32, dtype=dtype)
    assert layer._local_fn(x) is moe.fused_local_experts
    fused = _run(layer, x)
    layer.permute_fusion = False
    assert layer._local_fn(x) is moe.local_experts
    plain = _run(layer, x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.allclose(fused[0], plain[0], **tol) and torch.allclose(fused[1], plain[1], **tol)
    for name in plain[2]:
        assert torch.allclose(fused[2][name], plain[2][name], **tol), name


def test_fused_permutation_in_fp8_equals_the_separate_one():
    from paratron import fp8
    from paratron.fp8 import Recipe
    torch.manual_seed(1)
    layer = moe.MoELayer(_cfg(disable_bias_linear=True, moe_permute_fusion=True), Parallel())
    fp8.attach(layer, Recipe(emulate=True))
    x = torch.randn(8, 2, 32)
    fused = _run(layer, x)
    layer.permute_fusion = False
    plain = _run(layer, x)
    assert torch.allclose(fused[0], plain[0], atol=1e-5) and torch.allclose(fused[1], plain[1], atol=1e-5)
    assert torch.allclose(fused[2]["experts.linear_fc1.weight"], plain[2]["experts.linear_fc1.weight"], atol=1e-4)


def test_fused_expert_path_compiles_as_one_graph():
    torch.manual_seed(2)
    layer = moe.MoELayer(_cfg(moe_permute_fusion=True), Parallel(), dtype=torch.bfloat16)
    tokens = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    probs, rmap = layer.router(tokens.detach(), 8)
    args = (layer.experts, tokens, probs, rmap, 16 * 2)
    want = moe.fused_local_experts(*args)
    compiled = torch.compile(moe.fused_local_experts, fullgraph=True, dynamic=False, backend="eager")
    got = compiled(*args)  # fullgraph: a graph break (a host read of the counts) would raise
    assert torch.equal(got, want)
    g_want, = torch.autograd.grad(want.float().square().sum(), tokens)
    g_got, = torch.autograd.grad(got.float().square().sum(), tokens)
    assert torch.equal(g_got, g_want)
    layer.compile_experts()
    assert layer.local is not moe.local_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_combine_traced_by_aot_autograd_gives_eager_gradients(dtype):
    """The fused combine under torch.compile's autograd trace (aot_eager: no code generation). Under torch 2.11 a
    forward returning ``out.to(out.dtype)`` (``out`` itself: fp32 runs) was traced with a zero output gradient."""
    torch.manual_seed(0)
    y0, w0 = torch.randn(8, 4, dtype=dtype), torch.rand(3, 2, dtype=dtype)
    rows, src = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    row_weight = torch.rand(8, dtype=dtype)
    grads = []
    for compiled in (False, True):
        y, w = y0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn = lambda a, b: moe_experts._Combine.apply(a, b, rows, src, row_weight)  # noqa: E731
        (torch.compile(fn, backend="aot_eager") if compiled else fn)(y, w).float().square().sum().backward()
        grads.append((y.grad, w.grad))
    for eager, traced in zip(*grads):
        assert eager.norm() > 0 and torch.equal(traced, eager)


@pytest.mark.parametrize("fusion,recipe", [(True, None), (False, None), (True, "delayed"), (True, "blockwise")])
def test_no_host_reads_in_the_dropless_grouped_moe_layer(fusion, recipe):
    from paratron import fp8
    from paratron.fp8 import Recipe
    torch.manual_seed(3)
    width = 128 if recipe == "blockwise" else 32  # blockwise: whole 128 x 128 weight blocks per expert
    layer = moe.MoELayer(_cfg(moe_permute_fusion=fusion, moe_shared_expert_intermediate_size=16, hidden_size=width,
                              moe_ffn_hidden_size=width // 2 if recipe != "blockwise" else 128), Parallel())
    if recipe is not None:  # the routed experts in FP8 (emulated GEMMs; the scales stay on the device)
        assert fp8.attach(layer.experts, Recipe(format="e4m3", recipe=recipe, emulate=True)) == 2
    layer.train()
    x = torch.randn(8, 2, width, requires_grad=True)
    with HostReads() as reads:
        layer(x).square().sum().backward()
    assert reads.seen == [], reads.seen
    if recipe is not None:
        return
    # the counter is live: the loop over experts reads the counts, token dropping reads the kept pairs
    for cfg in (_cfg(moe_grouped_gemm=False), _cfg(moe_expert_capacity_factor=1.0)):
        with HostReads() as reads:
            moe.MoELayer(cfg, Parallel())(x.detach())
        assert reads.seen, cfg


def test_shared_expert_runs_while_the_dispatch_all_to_all_is_in_flight(monkeypatch):
    """all_to_all_overlapped: the collective starts asynchronously, ``meanwhile`` runs, then the wait; in backward
    the reverse all-to-all starts asynchronously, ``meanwhile``'s backward runs, then the wait, and the gradients
    are the plain ones (one rank: the collective is the identity here)."""
    from paratron.parallel import experts
    events = []

    class Handle:
        def wait(self):
            events.append("wait")

    def fake(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        events.append("start" if async_op else "sync")
        out.copy_(inp)
        return Handle() if async_op else None

    class Shared(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            events.append("shared")
            return t * 2

        @staticmethod
        def backward(ctx, g):
            events.append("shared backward")
            return g * 2

    monkeypatch.setattr(experts.dist, "all_to_all_single", fake)
    x, h = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    y, side = experts.all_to_all_overlapped(x, [5], [5], None, lambda: Shared.apply(h))
    assert events == ["start", "shared", "wait"] and torch.equal(y, x) and torch.equal(side, h * 2)
    ((y * 3).sum() + side.sum()).backward()
    assert events[3:] == ["start", "shared backward", "wait"]
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(h.grad, torch.full_like(h, 2.0))


def test_alltoall_padded_to_capacity_reads_no_counts(monkeypatch):
    """--moe-pad-expert-input-to-capacity: every rank routes exactly ``capacity`` rows per expert, so the alltoall
    dispatcher neither exchanges nor reads the counts (one rank, the collective a copy): no host read, and the
    one-rank expert path's output and gradients."""
    from paratron.parallel import experts as ep

    def copy(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        out.copy_(inp)
    monkeypatch.setattr(ep.dist, "all_to_all_single", copy)
    torch.manual_seed(7)
    layer = moe.MoELayer(_cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), Parallel())
    tokens = torch.randn(16, 32, requires_grad=True)
    probs, rmap = layer.router(tokens.detach(), 8)
    capacity = moe.expert_capacity(16, 2, 4, 1.0)
    assert (rmap.sum(dim=0) == capacity).all()
    with HostReads() as reads:
        got = ep.alltoall_dispatch(tokens, probs, rmap, layer.experts, ep.ExpertLayout(4), capacity=capacity)
        g_got, = torch.autograd.grad(got.square().sum(), tokens)
    assert reads.seen == [], reads.seen
    want = moe.local_experts(layer.experts, tokens, probs, rmap, capacity * 4)
    g_want, = torch.autograd.grad(want.square().sum(), tokens)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(g_got, g_want, atol=1e-5)


def test_dropless_fused_combine_gathers_each_tokens_rows(monkeypatch):
    """Dropless routing: the outputs come back by a gather of each token's k rows (no scatter-add), equal to the
    scatter-add of the weighted rows, with the gradients of the rows and of the probabilities; every real row is
    some token's, padding rows none."""
    torch.manual_seed(4)
    layer = moe.MoELayer(_cfg(moe_permute_fusion=True), Parallel())
    tokens = torch.randn(16, 32)
    probs, rmap = layer.router(tokens, 8)
    src, weight, row_expert, ends = moe.padded_layout(rmap, probs, 32, layer.experts.row_alignment())
    rows, chosen = moe_experts.token_rows(rmap, src, row_expert, 2)
    assert torch.equal(src[rows], torch.arange(16)[:, None].expand(16, 2)) and torch.equal(row_expert[rows], chosen)
    assert sorted(rows.flatten().tolist()) == [r for r in range(len(src)) if src[r] < 16]
    y = torch.randn(len(src), 32, requires_grad=True)
    p = probs.detach().clone().requires_grad_()
    got = moe_experts._Combine.apply(y, p.gather(1, chosen), rows, src, weight.detach())
    w_rows = p.new_zeros(len(src)).index_copy(0, rows.flatten(), p.gather(1, chosen).flatten())
    want = torch.zeros(17, 32).index_add(0, src, y * w_rows[:, None])[:-1]
    assert torch.allclose(got, want, atol=1e-6)
    g = torch.randn(16, 32)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(torch.autograd.grad(got, (y, p), g),
                                                               torch.autograd.grad(want, (y, p), g)))
    calls = []
    monkeypatch.setattr(moe_experts._Combine, "apply", lambda *a: calls.append(1) or torch.zeros(16, 32))
    moe.fused_local_experts(layer.experts, tokens, probs, rmap, 32)
    moe.fused_local_experts(layer.experts, tokens, probs, rmap, None)  # token dropping: the scatter-add
    assert calls == [1]


def test_rows_the_grouped_gemm_leaves_unwritten_reach_nothing(monkeypatch):
    """torch._grouped_mm writes no row past its last group (on a GPU those rows hold whatever memory held): with
    such rows poisoned with NaN, the fused path's outputs and gradients are finite and unchanged (the last group
    covers every row of the padded layout)."""
    torch.manual_seed(5)
    layer = moe.MoELayer(_cfg(moe_permute_fusion=True, disable_bias_linear=False), Parallel())
    layer.train()
    x = torch.randn(8, 3, 32)
    want = _run(layer, x)
    real = torch._grouped_mm

    def poisoned(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        past = torch.arange(out.shape[0]) >= offs[-1]
        return torch.where(past[:, None], torch.full_like(out, float("nan")), out)
    monkeypatch.setattr(torch, "_grouped_mm", poisoned)
    got = _run(layer, x)
    assert torch.isfinite(got[0]).all() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def test_rows_into_the_grouped_layout_keep_only_their_index_for_the_backward():
    """The padded grouped layout is filled by ``rows_at`` (index_put): its backward keeps the index, not a second
    copy of the rows (torch's index_copy keeps its whole source), so the grouped experts keep each row once, in
    the padded copy their GEMM reads; the values and the gradient are the copy's."""
    from paratron.model.moe_experts import rows_at
    x = torch.randn(6, 4, requires_grad=True)
    index = torch.tensor([0, 2, 3, 5, 6, 7])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = rows_at(x, index, 9)
    assert torch.equal(y[index], x) and torch.equal(y[[1, 4, 8]], torch.zeros(3, 4))
    assert saved and all(t.dtype == torch.long for t in saved), [t.dtype for t in saved]
    g = torch.randn(9, 4)
    y.backward(g)
    assert torch.equal(x.grad, g[index])
