"""The FP8 weight cache (paratron/fp8/weights.py): a step of several micro-batches casts each dense FP8 weight once.
Every dense FP8 path gives the same output and gradients from the cached copies as from its own cast (CPU
emulation, bit for bit), casts no weight while the cache is filled, and a training run's losses do not change with
it (tensorwise; close with the delayed recipe, whose weight amax is then recorded once a step)."""
import pytest
import torch

from paratron import fp8
from paratron.config import parse_args
from paratron.fp8 import FP8State, Recipe
from paratron.fp8 import weights
from paratron.fp8.mlp import SWIGLU, fused_mlp


class _Layer(torch.nn.Module):
    def __init__(self, weight, state):
        super().__init__()
        self.weight, self.fp8 = torch.nn.Parameter(weight), state


def _twice(fn, layers, x, g, cached):
    """Two micro-batches through ``fn``, the weights cast once before them (``cached``) or in the layer; the
    outputs, the input gradients, the summed weight gradients and the roles each forward cast."""
    for layer in layers:
        layer.weight.grad = None
        layer.fp8.trace = []
    if cached:
        weights.fill([(m, m.fp8) for m in layers])
        for layer in layers:
            layer.fp8.trace = []
    outs = []
    for _ in range(2):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(g)
        outs += [y.detach(), xi.grad]
    weights.drop([(m, m.fp8) for m in layers])
    roles = [r for layer in layers for r, _ in layer.fp8.trace]
    return outs + [layer.weight.grad for layer in layers], roles


def _states(recipe, n, fmt="hybrid", **kw):
    return [FP8State(Recipe(format=fmt, recipe=recipe, emulate=True, **kw)) for _ in range(n)]


def _dense_cases():
    torch.manual_seed(1)
    x, g = torch.randn(256, 128), torch.randn(256, 256)
    for recipe, fmt in (("tensorwise", "hybrid"), ("delayed", "hybrid"), ("blockwise", "e4m3")):
        layer = _Layer(torch.randn(256, 128) * 0.1, _states(recipe, 1, fmt)[0])
        yield f"linear-{recipe}", (lambda a, m=layer: fp8.fp8_linear(a, m.weight, m.fp8)), [layer], x, g
    s1, s2 = _states("tensorwise", 2)
    fc1, fc2 = _Layer(torch.randn(512, 128) * 0.1, s1), _Layer(torch.randn(128, 256) * 0.1, s2)
    yield "fused-mlp", (lambda a: fused_mlp(a, fc1.weight, None, fc2.weight, fc1.fp8, fc2.fp8, SWIGLU)), \
        [fc1, fc2], x, torch.randn(256, 128)


@pytest.mark.parametrize("case", list(_dense_cases()), ids=lambda c: c[0])
def test_the_cached_weights_give_the_same_numbers_and_no_weight_is_cast(case):
    _, fn, layers, x, g = case
    own, own_roles = _twice(fn, layers, x, g, cached=False)
    got, roles = _twice(fn, layers, x, g, cached=True)
    for a, b in zip(got, own):
        assert torch.equal(a, b)
    assert own_roles.count("weight") == 2 * len(layers) and "weight" not in roles, (own_roles, roles)


def test_the_cache_holds_the_copies_the_backward_reads():
    """Tensorwise: the e4m3 weight and its column-major copy; blockwise: the blocks and their scales (its backward
    reads them as they are); the routed experts (a 3-D weight) are not cached."""
    dense = _Layer(torch.randn(64, 32), _states("tensorwise", 1)[0])
    wq, sw, wt = weights.cast(dense.fp8, dense.weight)
    assert wq.dtype == torch.float8_e4m3fn and torch.equal(wt.float(), wq.float()) and wt.stride() == (1, 64)
    block = _Layer(torch.randn(128, 128), _states("blockwise", 1, "e4m3")[0])
    wq, sw, wt = weights.cast(block.fp8, block.weight)
    assert wq.dtype == torch.float8_e4m3fn and sw.shape == (1, 1) and wt is None
    experts = _Layer(torch.randn(2, 64, 32), _states("tensorwise", 1)[0])
    assert weights.cached_layers([experts]) == [] and weights.describe([experts]) == ""


class _Wrapper(torch.nn.Module):
    def __init__(self, inner, **attrs):
        super().__init__()
        self.inner = inner
        self.__dict__.update(attrs)


def test_the_cache_is_off_where_the_weights_are_not_in_place_at_the_start_of_a_step():
    layer = _Layer(torch.randn(32, 32), _states("tensorwise", 1)[0])
    assert weights.cached_layers([_Wrapper(layer)]) == [(layer, layer.fp8)]
    assert "once per step" in weights.describe([_Wrapper(layer)])
    zero3 = _Wrapper(layer, units=type("U", (), {"params_sharded": True})())
    assert weights.cached_layers([zero3]) == [] and "ZeRO-3" in weights.describe([zero3])
    overlap = _Wrapper(layer, overlap_param_gather=True)
    assert weights.cached_layers([overlap]) == [] and "--overlap-param-gather" in weights.describe([overlap])
    off = _Layer(torch.randn(32, 32), FP8State(Recipe(emulate=True, weight_cache=False)))
    assert weights.cached_layers([off]) == []
    assert "(once per step: --kernel-fp8-weight-cache on)" in weights.describe([off])
    assert weights.describe([torch.nn.Linear(2, 2)]) == ""


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm",
       "--disable-bias-linear"]


@pytest.mark.parametrize("extra", [["--fp8-recipe", "tensorwise"],
                                   pytest.param(["--fp8-recipe", "tensorwise", "--torch-compile"],
                                                marks=pytest.mark.slow),  # (15 s; moe-compiled compiles in CI)
                                   ["--fp8-recipe", "tensorwise", "--fp8-format", "e4m3", *MOE],
                                   ["--fp8-recipe", "tensorwise", "--fp8-format", "e4m3", "--torch-compile",
                                    "--moe-permute-fusion", *MOE], []],
                         ids=["tensorwise", "compiled", "moe", "moe-compiled", "delayed"])
def test_training_with_the_cache_gives_the_same_losses_and_drops_it_after_the_step(monkeypatch, extra):
    """Two micro-batches a step, the cache against --disable-parameter-transpose-cache: the same losses, step by
    step; during the step the layers read the cache (filled once), after it nothing is held. With the delayed
    recipe the weight's amax is recorded once a step with the cache, so the second micro-batch casts the weight
    with the step's first scale (as Transformer Engine does) where the layer's own cast takes the amax it has just
    recorded: close, not equal."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    flags = TINY + ["--train-iters", "3", "--bf16", "--fp8-format", "hybrid", "--device", "cpu", *extra]
    runs, fills = {}, []
    real_fill = weights.fill
    monkeypatch.setattr(weights, "fill", lambda layers: (fills.append(len(layers)), real_fill(layers)))
    for name, more in (("cached", ["--kernel-fp8-weight-cache", "on"]), ("own", [])):
        trainer = Trainer(parse_args(flags + more))
        runs[name] = losses_of(trainer, 3)
        states = [m.fp8 for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
        assert states and all(s.weight_cache is None for s in states)
    if extra:
        assert runs["cached"] == runs["own"], runs
    else:
        assert runs["cached"][0] == runs["own"][0] and runs["cached"] == pytest.approx(runs["own"], rel=1e-3), runs
    # once a step, none with the flag: 2 layers x QKV, proj, fc1, fc2 (MoE: QKV and proj; the routed experts cast
    # their weights at every micro-batch)
    assert fills == [4 if "--num-experts" in extra else 8] * 3, fills


def test_the_plan_counts_the_cached_copies_of_every_layer_for_the_step():
    """`paratron plan`: a step of several micro-batches holds the FP8 copies (weight and transpose, a byte each)
    of every layer of the rank; one micro-batch, or the flag, one layer's at a time."""
    from tests.unit.test_train import TINY
    from paratron.plan.layout import layout_of
    from paratron.plan.memory import rank_memory

    def comm(*more):
        cfg = parse_args(TINY + ["--train-iters", "1", "--bf16", "--fp8-format", "hybrid", "--device", "cpu", *more])
        return rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).comm

    one_layer = comm()  # (auto: the cache off)
    assert comm("--kernel-fp8-weight-cache", "on", "--disable-parameter-transpose-cache") == one_layer
    every_layer = comm("--kernel-fp8-weight-cache", "on")  # TINY: two micro-batches a step, two layers
    # on top of one layer's copies: a byte a weight element and a byte its transpose, of both layers' QKV [192, 64],
    # proj [64, 64], fc1 [256, 64] and fc2 [64, 256] (TINY: hidden 64, GeLU MLP of 4 x 64)
    h = 64
    assert every_layer - one_layer == 2 * 2 * (3 * h * h + h * h + 2 * 4 * h * h) and one_layer > 0
    assert comm("--kernel-fp8-weight-cache", "on", "--global-batch-size", "2") == one_layer
