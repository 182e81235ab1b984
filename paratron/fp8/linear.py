"""The FP8 linear: ``y = x W^T`` with x and W in e4m3 and the output gradient in e5m2 (``hybrid``) or e4m3,
the gradients from the FP8 copies the forward saved; the layers that take it (``attach``), the device check,
and the delayed recipe's amax histories as checkpoints store them. The scaling recipes are in
paratron/fp8/recipe.py; the casts in paratron/kernels/fp8_cast.py.

Megatron's gradient-accumulation fusion (the weight gradient added to its float32 ``main_grad`` by the backward)
is taken by the blockwise recipe's linear (``fuses_wgrad``, paratron/fp8/blockwise.py); the tensorwise and
delayed recipes' weight gradients go to autograd."""
from __future__ import annotations

from typing import Optional

import torch

from . import weights
from .blockwise import block_linear
from .recipe import LAYERS, FP8State, Recipe, column_major, forward_mm, input_grad_mm, scaled_mm

class _FP8Linear(torch.autograd.Function):
    """y = x W^T with x and W in e4m3; the gradients from the FP8 output gradient and the saved FP8
    copies of x and W (the bf16 x is not kept). With ``--no-fp8-wgrad`` (``Recipe.fp8_wgrad`` False)
    the weight gradient is g^T x in the input's dtype from the bf16 g and x (x kept instead of its FP8
    copy); the input gradient stays FP8."""

    @staticmethod
    def forward(ctx, x, weight, state, wq, sw, wt):
        x2 = x.reshape(-1, x.size(-1))
        y, xq, sx, wq, sw = forward_mm(x2, weight, state, x.dtype, wq, sw)
        ctx.save_for_backward(xq if state.recipe.fp8_wgrad else x2, wq, sx, sw, wt)
        ctx.state, ctx.x_shape, ctx.w_dtype = state, x.shape, weight.dtype
        return y.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, g):
        x_saved, wq, sx, sw, wt = ctx.saved_tensors
        state, emulate = ctx.state, ctx.state.recipe.emulate
        g2 = g.reshape(-1, g.size(-1))
        if state.recipe.fp8_wgrad:
            gq, gqt, sg = state.quantize_grad(g2)
        else:
            gq, sg = state.quantize("grad", g2)
        gx = gw = None
        if ctx.needs_input_grad[0]:  # [m, n] @ [n, k]
            gx = input_grad_mm(gq, sg, wq, sw, g.dtype, emulate, wt).view(ctx.x_shape)
        if ctx.needs_input_grad[1] and state.recipe.fp8_wgrad:  # [n, m] @ [m, k]
            gw = scaled_mm(gqt, column_major(x_saved), sg, sx, ctx.w_dtype, emulate)
        elif ctx.needs_input_grad[1]:
            gw = (g2.t() @ x_saved).to(ctx.w_dtype)
        return gx, gw, None, None, None, None


def fuses_wgrad(state: Optional[FP8State]) -> bool:
    """Whether a layer with this FP8 state (None: none) adds its weight gradient to ``main_grad`` when given one:
    the blockwise recipe's linear and fused MLP do; the tensorwise and delayed recipes' do not."""
    return state is not None and state.recipe.recipe == "blockwise"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: FP8State,
               main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) with FP8 inputs per ``state``'s recipe; output in x's dtype. ``main_grad``:
    the weight's float32 gradient buffer, which the backward adds the weight gradient to (only where
    ``fuses_wgrad(state)``)."""
    wq, sw, wt = state.cached_weight()  # the step's cached FP8 weight (fp8/weights.py), or Nones
    if state.recipe.recipe == "blockwise":
        return block_linear(x, weight, state, wq, sw, main_grad)
    if main_grad is not None:
        raise ValueError(f"the {state.recipe.recipe} FP8 recipe's linear does not add its weight gradient to "
                         "main_grad (gradient-accumulation fusion is the blockwise recipe's)")
    return _FP8Linear.apply(x, weight, state, wq, sw, wt)


def attach(model: torch.nn.Module, recipe: Optional[Recipe], num_layers: Optional[int] = None,
           prefix: str = "decoder") -> int:
    """Give each transformer QKV / proj / fc1 / fc2 layer of ``model`` its own FP8State (embedding and
    output layer stay in the parameters' dtype). ``num_layers``: the decoder's (global) layer count, for
    the recipe's first / last layers kept out of FP8 (``model`` a decoder stack: its layers' indices).
    ``prefix``: ``model``'s name in Megatron's model, for --te-precision-config-file's matchers, which see each
    layer under its global number (``decoder.layers.5.self_attention.linear_qkv`` on whichever pipeline stage
    holds layer 5); a layer a matcher chose keeps the matcher's name in ``precision_rule``.
    Returns how many layers got one."""
    if recipe is None:
        return 0
    layers = getattr(model, "layers", [])
    skip = {id(m) for layer in layers if num_layers is not None
            and recipe.in_bf16(layer.index, num_layers) for m in layer.modules()}
    n = 0
    for name, module in fp8_layers(model):
        if id(module) not in skip:
            own, rule = recipe.for_module(megatron_name(name, prefix, layers if num_layers is not None else None))
            module.precision_rule = rule.matcher if rule is not None else None
            if own is not None:
                module.fp8 = FP8State(own, module.weight.device)
                n += 1
    return n


def fp8_layers(model: torch.nn.Module):
    """(name, module) of each layer of ``model`` that can run in FP8 (a QKV / proj / fc1 / fc2 with an ``fp8`` slot)."""
    return [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in LAYERS and hasattr(m, "fp8")]


def megatron_name(name: str, prefix: str, layers) -> str:
    """``prefix.name``, the local layer number of ``layers.i.`` replaced by the layer's global one."""
    parts = name.split(".")
    if layers is not None and len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        parts[1] = str(layers[int(parts[1])].index)
    return ".".join([prefix, *parts])


def coverage(models) -> str:
    """What runs in FP8, for the start-up line: the layers per recipe, those kept in the parameters' dtype, and
    --te-precision-config-file's matchers with the layers each chose."""
    recipes, kept, rules = {}, 0, {}
    for model in models:
        for _, module in fp8_layers(model):
            state = module.fp8
            if state is None:
                kept += 1
            else:
                recipes[state.recipe.recipe] = recipes.get(state.recipe.recipe, 0) + 1
            rule = getattr(module, "precision_rule", None)
            if rule is not None:
                rules[rule] = rules.get(rule, 0) + 1
    text = ", ".join(f"{n} {r}" for r, n in recipes.items()) or "none"
    text = f"FP8 linears: {text}; in the parameters' dtype: {kept}"
    if rules:
        text += " (--te-precision-config-file matchers: " + ", ".join(f"{r} {n}" for r, n in rules.items()) + ")"
    return text


def device_problem(device: str) -> Optional[str]:
    """Why FP8 matmuls cannot run on ``device`` ('cpu' / 'cuda'), or None when they can: a GPU needs FP8 tensor
    cores; a CPU run (``device`` cpu, or no GPU) emulates the recipe (train/step.build_model), its numbers, not its
    speed."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return ("--fp8-format needs an FP8-capable GPU (Hopper/Ada, compute capability >= 8.9); this run is on "
                f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    return None


def experts_paths(models) -> str:
    """How the routed experts in FP8 run, for the start-up line: "" without them, else how many layers take the
    fused FP8 experts MLP (fp8/experts_mlp.py) and how many run GEMM by GEMM, with the first reason."""
    paths = [m.fp8_path() for model in models for m in model.modules() if hasattr(m, "fp8_path")]
    paths = [p for p in paths if p is not None]
    if not paths:
        return ""
    fused = paths.count("fused")
    other = next((p for p in paths if p != "fused"), None)
    parts = ([f"{fused} as the fused FP8 MLP"] if fused else []) + (
        [f"{len(paths) - fused} GEMM by GEMM ({other})"] if other else [])
    return "; routed experts: " + ", ".join(parts)


def startup_line(models, bf16: bool, device: torch.device) -> str:
    """What --fp8-format covers on this rank, said once at start-up (and, on a CPU, what the run is for)."""
    rest = "bf16" if bf16 else "fp32"
    line = (f" {coverage(models)}{experts_paths(models)}{weights.describe(models)}; embedding, router and output "
            f"layer in {rest}")
    if device.type == "cpu":
        line += "; on the CPU: the recipe emulated (dequantised fp32 matmuls), to try a configuration, not its speed"
    return line


def delayed_states(models) -> list:
    """The FP8States of the delayed recipe in ``models``, in module order (the same on every run of
    the same layout)."""
    return [m.fp8 for model in models for m in model.modules()
            if getattr(m, "fp8", None) is not None and m.fp8.recipe.recipe == "delayed"]


def histories(states: list) -> Optional[torch.Tensor]:
    """One flat copy of every amax history of ``states`` (None when there are none)."""
    hs = [s.history for st in states for s in st.scalers]
    return torch.cat(hs) if hs and all(h is not None for h in hs) else None


def set_histories(states: list, flat: torch.Tensor) -> None:
    """Write a flat copy made by :func:`histories` back (a resumed run goes on with the saved amaxes)."""
    for s, h in zip([s for st in states for s in st.scalers], flat.split(states[0].recipe.amax_history_len)):
        s.history.copy_(h)
        s.primed = bool(h.any())


def prime(states: list) -> None:
    """After a training step: every delayed scaler of ``states`` takes its scale from its history alone
    from now on (the step recorded an amax in each). Flips Python flags that compiled layers are
    specialised on: they are traced once more, with the single-pass casts."""
    for st in states:
        for s in st.scalers:
            s.primed = True
