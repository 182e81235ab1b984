"""The code paths a layout's layers take on the planned GPU: the kernel switches (config/kernels.py) resolved as
the training run resolves them (kernels/switches.py), for a GPU kind instead of the device at hand, and the
model's own conditions of each path (model/norms.py, model/mlp.py, model/attention/flash.py). What the layers save
for backward (activations.py) depend on them.

``kind`` None plans the paths of the machine the config is resolved on: a CPU, or a run's own already resolved
switches (the start-up lines of a training run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config

HOPPER = ("h100", "h200")  # the kinds FlashAttention-4's and quack's kernels are built for (compute capability 9.0)


@dataclass(frozen=True)
class Paths:
    """What the layers run. Defaults: the plain torch paths (a CPU)."""
    quack_norm: bool = False  # RMSNorm on quack's kernel: keeps its bf16 input and 1/rms (not an fp32 copy)
    gated_gemm: bool = False  # SwiGLU MLP in quack's GEMM epilogues: keeps the pre-activation (and the activation)
    keep_act: bool = True  # --kernel-keep-swiglu-activation (the gated GEMMs' activation kept for fc2's wgrad)
    fused_rope: bool = False  # the rotary embedding inside FlashAttention-4's op (recomputed with it: selective)
    fp8_inputs: bool = False  # FP8 linears keep their inputs' FP8 copies (1 byte), not the bf16 inputs
    fp8_mlp: bool = False  # the fused FP8 MLP: keeps fc1's input in FP8, its output in bf16, the activation in FP8
    scan_recompute: bool = True  # --kernel-linear-scan-recompute on: the torch scans keep their inputs only


def _resolved(cfg: Config, kind: Optional[str]):
    """The kernel switches as the run on ``kind`` resolves them (config already resolved: as they are)."""
    from ..kernels import switches
    k = cfg.kernels
    if kind is None and switches.device_resolved(k):  # a run's switches, resolved on its GPU: not again on a CPU
        return k
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32
    offered = None if kind is None else switches.offer_of_kind(kind in HOPPER and dtype == torch.bfloat16)
    return switches.resolve(k, "cpu", dtype, bool(cfg.train.deterministic_mode), offered)


def paths_of(cfg: Config, kind: Optional[str] = None) -> Paths:
    """The paths of ``cfg``'s layers on a ``kind`` GPU (None: as resolved here); each module's own condition
    taken from the model: quack's RMSNorm for a plain RMSNorm of whole 16-byte rows, the gated GEMMs for the
    fused SwiGLU without biases or FP8, the fused rotary attention for plain rope over whole heads."""
    from ..fp8 import mlp as fp8_mlp
    from ..fp8.recipe import Recipe
    from ..model.variants import fused_fp8_activation
    m, k = cfg.model, _resolved(cfg, kind)
    recipe = Recipe.from_config(cfg.train, k)
    bias = not m.disable_bias_linear
    norm = k.kernel_rmsnorm == "quack" and m.normalization == "RMSNorm" and not m.apply_layernorm_1p \
        and m.hidden_size % 8 == 0
    swiglu = fused_fp8_activation(m) == fp8_mlp.SWIGLU
    gated = k.kernel_gated_mlp == "quack" and swiglu and not bias and recipe is None and m.ffn_hidden_size % 8 == 0
    flash = k.attention_backend in ("flash", "fused") and not m.multi_latent_attention
    rope = flash and not k.no_rope_fusion and m.position_embedding_type == "rope" and m.attention_dropout == 0
    fp8 = recipe is not None and recipe.fp8_wgrad and recipe.recipe != "blockwise"
    fp8_mlp_on = fp8 and recipe.fuse_mlp and fused_fp8_activation(m) is not None
    return Paths(norm, gated, k.kernel_keep_swiglu_activation == "on", rope, fp8, fp8_mlp_on,
                 k.kernel_linear_scan_recompute == "on")
