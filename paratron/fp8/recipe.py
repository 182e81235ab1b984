"""FP8 matmuls for the transformer's linear layers (``--fp8-format``, ``--fp8-recipe``).

Scaling, as Transformer Engine / Megatron define it: a tensor ``x`` is stored as
``q = saturate(x * scale)`` in an FP8 type and read back as ``q / scale``, with
``scale = fmax / (amax * 2**margin)`` (``fmax`` = 448 for e4m3, 57344 for e5m2; ``amax`` = max |x|;
scale 1 where amax is 0, inf or NaN, or the quotient overflows). Recipes:

* ``tensorwise`` (current scaling): the amax of the tensor being quantised, now.
* ``blockwise``: DeepSeek-V3's scaling, a scale per 1 x 128 tile of activations and gradients and per
  128 x 128 block of weights, every tensor in e4m3 (paratron/fp8/blockwise.py, kernels/fp8_block.py).
* ``delayed``: the amax comes from a history of the last ``--fp8-amax-history-len`` amaxes of that
  tensor (``max`` of the history or its ``most_recent`` entry). The scale used for a matmul is
  computed from the history *before* the current amax is recorded; the history is then rolled and the
  current amax written at its head. Before anything is recorded (the first use) the current amax is
  used, so no step runs with an arbitrary scale. After the first training step the scale depends on
  the history alone (``Scaler.primed``): a compiled layer then writes the FP8 copy in the same pass
  that computes the tensor, where tensorwise needs one pass for the amax and another for the cast.

Forward: input and weight in e4m3. Backward: the output gradient in e5m2 (``hybrid``) or e4m3
(``e4m3``); grad_input = g @ W and grad_weight = g^T @ x reuse the FP8 copies saved by the forward.
The matmuls are ``torch._scaled_mm`` (first operand row-major, second column-major, every dimension a
multiple of 16; it takes the *inverse* scales). ``emulate=True`` replaces them with
dequantise -> fp32 matmul: for the CPU unit tests of the numerics only, never chosen by a run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config.precision_file import Rule, first_match, read_rules
from ..config.values import FP8_AMAX_ALGOS, FP8_FORMATS, FP8_RECIPES, FP8_REFUSED_RECIPES
from ..kernels.fp8_cast import E4M3, E5M2, FMAX, amax, cast_fp8, compute_scale, dequantize, quantize  # noqa: F401

# the legal values (the config validates the flags with these)
FORMATS, RECIPES, REFUSED_RECIPES, AMAX_ALGOS = FP8_FORMATS, FP8_RECIPES, FP8_REFUSED_RECIPES, FP8_AMAX_ALGOS
LAYERS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",  # the FP8 layers of a transformer block
          "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")  # and multi-latent attention's parallel ones
FAST_ACCUM_FORWARD = True  # the forward GEMM with Hopper's fast FP8 accumulation (as torchao); backward without
FUSED_CAST_DEVICES = ("cuda",)  # where amax and the scaled cast run as compiled kernels outside compiled regions


@dataclass(frozen=True)
class Recipe:
    """The FP8 settings of a run (TrainConfig's fp8_* fields)."""
    format: str = "hybrid"
    recipe: str = "tensorwise"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    emulate: bool = False  # CPU runs and tests: dequantise + fp32 matmul instead of torch._scaled_mm
    fuse_mlp: bool = True  # the MLP as one FP8 function (fp8/mlp.py, experts_mlp.py; --kernel-fp8-fused-mlp)
    grad_cast_op: bool = True  # output gradients cast by paratron::cast_fp8 (--kernel-fp8-grad-cast): else torch ops
    fp8_wgrad: bool = True  # --no-fp8-wgrad: weight gradients from the bf16 input and output gradient
    bf16_at_start: int = 0  # --first-last-layers-bf16: the first / last decoder layers stay in the params' dtype
    bf16_at_end: int = 0
    block_gemm: str = "dequant"  # blockwise recipe's GEMMs (--kernel-fp8-block-gemm): scaled_mm | deepgemm | dequant
    grouped_gemm: str = "dequant"  # routed experts' FP8 GEMMs (--kernel-fp8-grouped-gemm): scaled_grouped_mm | deepgemm
    block_grouped_gemm: str = "dequant"  # ... under the blockwise recipe (--kernel-fp8-block-grouped-gemm): deepgemm | triton
    block_grouped_wgrad: str = "dequant"  # ... their weight gradients (--kernel-fp8-block-grouped-wgrad): triton
    block_cast: str = "torch"  # blockwise tile casts in both layouts (--kernel-fp8-block-cast): triton | torch
    weight_cache: bool = True  # FP8 weights cast once per step of several micro-batches (fp8/weights.py)
    overrides: tuple[Rule, ...] = ()  # --te-precision-config-file's matchers (config/precision_file.py), in order

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    @classmethod
    def from_config(cls, tr, kernels=None, emulate: bool = False) -> Optional["Recipe"]:
        """The recipe of a TrainConfig and the run's kernel switches (``kernels``: a KernelConfig; None: the
        defaults), None when FP8 is off; ``emulate``: dequantised fp32 matmuls (a CPU run: torch's CPU FP8 matmul
        is a slow reference, the emulation gives the same products)."""
        if not tr.fp8_format:
            return None
        fuse = kernels is None or kernels.kernel_fp8_fused_mlp != "off"
        grad_op = kernels is None or kernels.kernel_fp8_grad_cast != "off"
        block = getattr(kernels, "kernel_fp8_block_gemm", "auto")
        grouped = getattr(kernels, "kernel_fp8_grouped_gemm", "auto")
        block_grouped = getattr(kernels, "kernel_fp8_block_grouped_gemm", "auto")
        block_wgrad = getattr(kernels, "kernel_fp8_block_grouped_wgrad", "auto")
        block_cast = getattr(kernels, "kernel_fp8_block_cast", "auto")
        edges = (tr.num_layers_at_start_in_bf16, tr.num_layers_at_end_in_bf16) if tr.first_last_layers_bf16 else (0, 0)
        return cls(tr.fp8_format, tr.fp8_recipe, tr.fp8_amax_history_len, tr.fp8_amax_compute_algo, tr.fp8_margin,
                   fuse_mlp=fuse, grad_cast_op=grad_op, fp8_wgrad=not tr.no_fp8_wgrad, bf16_at_start=edges[0],
                   bf16_at_end=edges[1], block_gemm="dequant" if block == "auto" else block,
                   grouped_gemm="dequant" if grouped == "auto" else grouped,
                   block_grouped_gemm="dequant" if block_grouped == "auto" else block_grouped,
                   block_grouped_wgrad="dequant" if block_wgrad == "auto" else block_wgrad,
                   block_cast="torch" if block_cast == "auto" else block_cast,
                   weight_cache=weight_cache_asked(tr, kernels),
                   overrides=read_rules(tr.te_precision_config_file), emulate=emulate)

    def for_module(self, name: str) -> tuple[Optional["Recipe"], Optional[Rule]]:
        """(the recipe of the module called ``name`` (Megatron's name; None: it stays in the parameters' dtype), the
        matcher of --te-precision-config-file that chose it, None when the run's recipe applies unchanged)."""
        rule = first_match(self.overrides, name)
        if rule is not None and rule.recipe is None:
            return None, rule
        return replace(self, recipe=rule.recipe if rule else self.recipe, overrides=()), rule

    def in_bf16(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` (global, 0-based) of ``num_layers`` stays out of FP8."""
        return layer < self.bf16_at_start or layer >= num_layers - self.bf16_at_end


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    """``fn`` compiled once (dynamic shapes)."""
    return torch.compile(fn, dynamic=True)


def weight_cache_asked(tr, kernels) -> bool:
    """Whether a run asks for the FP8 weight cache (fp8/weights.py): ``--kernel-fp8-weight-cache on`` (``kernels``:
    its KernelConfig, None: the defaults, off) without Megatron's ``--disable-parameter-transpose-cache``."""
    return getattr(kernels, "kernel_fp8_weight_cache", "off") == "on" and not tr.disable_parameter_transpose_cache


def _fused(fn, x: torch.Tensor):
    """``fn`` as one compiled kernel (dynamic shapes: one per function and FP8 type) on the devices of
    FUSED_CAST_DEVICES, when not already inside a compiled region (which fuses it itself); eager, the
    cast alone is four passes over the tensor and an fp32 temporary."""
    if x.device.type not in FUSED_CAST_DEVICES or torch.compiler.is_compiling():
        return fn
    return _compiled(fn)


class Scaler:
    """The scale of one tensor role (input, weight or output gradient) of one layer.

    Delayed recipe: ``history`` holds the last amaxes, newest first. ``primed`` (a Python flag, set by
    :func:`prime` after the first training step and when histories are loaded) says the history can
    be trusted on its own: the scale then comes from the history alone, so a compiled layer can cast a
    tensor in the same pass that produces it (the amax is recorded from that pass too). Until then the
    scale is taken from the history where it holds a positive amax and from the current amax where it
    does not (the first use), which needs the current amax before the cast."""

    def __init__(self, recipe: Recipe, dtype: torch.dtype, device=None):
        self.recipe, self.dtype = recipe, dtype
        self.delayed = recipe.recipe == "delayed"
        self.history: Optional[torch.Tensor] = None  # delayed: [history_len] amaxes, newest first
        if self.delayed and device is not None:
            self.history = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device)
        self.primed = False

    @property
    def known(self) -> bool:
        """Whether the scale is known before the tensor is seen (a primed delayed scaler): the casting kernels
        then launch no amax pass."""
        return self.delayed and self.primed

    def _past(self, device) -> torch.Tensor:
        """The amax the history gives (its max or its newest entry; 0 while it holds nothing)."""
        if self.history is None:
            self.history = torch.zeros(self.recipe.amax_history_len, dtype=torch.float32, device=device)
        return self.history.amax() if self.recipe.amax_compute_algo == "max" else self.history[0]

    def _scale(self, a: torch.Tensor) -> torch.Tensor:
        return compute_scale(a, FMAX[self.dtype], self.recipe.margin)

    def preset_scale(self, device) -> torch.Tensor:
        """The scale known before the tensor is seen, as a 0-dim tensor: 0 means "scale from the
        current amax" (tensorwise; delayed while the history is empty and not primed)."""
        if not self.delayed:
            return torch.zeros((), dtype=torch.float32, device=device)
        past = self._past(device)
        if self.primed:
            return self._scale(past)
        return torch.where(past > 0, self._scale(past), torch.zeros_like(past))

    def record(self, current: torch.Tensor) -> None:
        """Delayed: the history rolled by one with ``current`` at its head (a functional update, so a
        compiled region can do it)."""
        if self.delayed:
            self._past(current.device)
            self.history.copy_(torch.cat([current.reshape(1).float(), self.history[:-1]]))

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantise ``x`` with now; records x's amax (delayed)."""
        current = _fused(amax, x)(x)
        if not self.delayed:
            return self._scale(current)
        past = self._past(x.device)
        scale = self._scale(past if self.primed else torch.where(past > 0, past, current))
        self.record(current)
        return scale

    def quantize(self, x: torch.Tensor):
        scale = self.scale_for(x)
        return _fused(quantize, x)(x, scale, self.dtype), scale

    def quantize_both(self, x: torch.Tensor):
        """2-D ``x`` quantised row-major and transposed (the weight gradient's operand): (q, qt, scale),
        the scale chosen as by :meth:`quantize`. By default one op (``paratron::cast_fp8``: on CUDA a
        Triton kernel that reads x once and writes the cast, its transpose and the amax);
        in a compiled region Inductor otherwise fuses the amax into the kernel producing x, which for
        the QKV gradient, assembled from attention's three permuted gradients, ran far slower than the
        plain assembly (benchmarks/results/profile_kernels_gpt-350m_fp8delayed_fusedgelu_mb32x2_5fe9ba3.tsv).
        ``--kernel-fp8-grad-cast off`` keeps the torch ops."""
        if not self.recipe.grad_cast_op:
            q, scale = self.quantize(x)
            return q, q.t().contiguous(), scale
        q, qt, scale, current = torch.ops.paratron.cast_fp8(x.contiguous(), self.preset_scale(x.device),
                                                            self.dtype == E5M2, self.recipe.margin, self.known)
        self.record(current)
        return q, qt, scale


class FP8State:
    """What one linear layer keeps between its FP8 matmuls: a scaler per tensor role. ``trace`` (a
    list, None by default) receives (role, fp8 dtype) for each quantisation: tests read it.
    ``weight_cache``: the FP8 copies of the layer's weight for the rest of a training step (fp8/weights.py), or
    None: the layer casts its weight itself at each forward."""

    def __init__(self, recipe: Recipe, device=None):
        self.recipe = recipe
        self.input = Scaler(recipe, E4M3, device)
        self.weight = Scaler(recipe, E4M3, device)
        self.grad = Scaler(recipe, recipe.grad_dtype, device)
        self.trace: Optional[list] = None
        self.weight_cache: Optional[tuple] = None

    @property
    def scalers(self) -> tuple:
        return self.input, self.weight, self.grad

    def mark(self, role: str) -> None:
        """Note a quantisation of ``role`` in the trace (also for one made outside this state's scalers)."""
        if self.trace is not None:
            self.trace.append((role, getattr(self, role).dtype))

    def quantize(self, role: str, x: torch.Tensor):
        self.mark(role)
        return getattr(self, role).quantize(x)

    def cached_weight(self) -> tuple:
        """The step's cached (wq, sw, wt) of the layer's weight (fp8/weights.py), or three Nones: the layer casts
        its weight itself."""
        cached = self.weight_cache
        return (None, None, None) if cached is None else cached

    def quantize_grad(self, g: torch.Tensor):
        """The output gradient ``g`` [m, n] in FP8, row-major and transposed: (gq, gq^T, scale)."""
        self.mark("grad")
        return self.grad.quantize_both(g)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
              emulate: bool, fast_accum: bool = False) -> torch.Tensor:
    """(a / sa) @ (b / sb) for FP8 ``a`` [m, k] (row-major) and ``b`` [k, n] (column-major)."""
    if emulate:
        return (dequantize(a, sa) @ dequantize(b, sb)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same shape and values, laid out column-major (as _scaled_mm's second operand)."""
    return t.t().contiguous().t()


def forward_mm(x2: torch.Tensor, weight: torch.Tensor, state: FP8State, out_dtype: torch.dtype,
               wq: Optional[torch.Tensor] = None, sw: Optional[torch.Tensor] = None):
    """x2 [m, k] @ weight^T with both quantised by ``state`` (the weight's FP8 copy ``wq``, ``sw`` where given, from
    the step's weight cache): (y, xq, sx, wq, sw)."""
    xq, sx = state.quantize("input", x2)
    if wq is None:
        wq, sw = state.quantize("weight", weight)
    return scaled_mm(xq, wq.t(), sx, sw, out_dtype, state.recipe.emulate, FAST_ACCUM_FORWARD), xq, sx, wq, sw


def input_grad_mm(gq: torch.Tensor, sg: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
                  emulate: bool, wt: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The input gradient g W: FP8 ``gq`` [m, n] times the forward's FP8 weight ``wq`` [n, k] (``wt``: its
    column-major copy where the weight cache made one; else made here)."""
    return scaled_mm(gq, column_major(wq) if wt is None else wt, sg, sw, out_dtype, emulate)


# ---- the delayed recipe's amax histories in checkpoints ----------------------------------------

