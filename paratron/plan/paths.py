"""The code paths a layout's layers take on the planned GPU: the kernel switches (config/kernels.py) resolved as
the training run resolves them (kernels/switches.py), for a GPU kind instead of the device at hand, and the
model's own conditions of each path (model/norms.py, model/mlp.py, model/attention/flash.py). What the layers save
for backward (activations.py) depend on them.

``kind`` None plans the paths of the machine the config is resolved on: a CPU, or a run's own already resolved
switches (the start-up lines of a training run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import Config

HOPPER = ("h100", "h200")  # the kinds FlashAttention-4's and quack's kernels are built for (compute capability 9.0)


@dataclass(frozen=True)
class Paths:
    """What the layers run. Defaults: the plain torch paths (a CPU)."""
    quack_norm: bool = False  # RMSNorm on quack's kernel: keeps its bf16 input and 1/rms (not an fp32 copy)
    gated_gemm: bool = False  # SwiGLU MLP in quack's GEMM epilogues: keeps the pre-activation (and the activation)
    keep_act: bool = True  # --kernel-keep-swiglu-activation (the gated GEMMs' activation kept for fc2's wgrad)
    fused_rope: bool = False  # the rotary embedding inside FlashAttention-4's op (recomputed with it: selective)
    fp8_inputs: bool = False  # the MLP's FP8 linears keep their inputs' FP8 copies (1 byte), not the bf16 inputs
    fp8_mlp: bool = False  # the fused FP8 MLP: keeps fc1's input in FP8, its output in bf16, the activation in FP8
    scan_recompute: bool = True  # --kernel-linear-scan-recompute on: the torch scans keep their inputs only
    fp8_qkv: bool = False  # the attention's QKV projection in FP8: keeps its input's FP8 copy
    fp8_proj: bool = False  # the attention's output projection in FP8: keeps its input's FP8 copy
    fp8_tiles: bool = False  # the blockwise recipe: each FP8 copy with a float32 scale per 1 x 128 tile besides
    shared: Optional["Paths"] = None  # the shared expert's MLP (None: as the dense MLP's)
    experts_fp8: str = ""  # the routed experts' FP8 path: "" (bf16's saved tensors), fused (fp8/experts_mlp.py), layer
    expert_align: int = 16  # FP8 experts' rows padded per expert to a multiple of it (blockwise: 128; fp8/experts.py)
    bf16: Optional["Paths"] = None  # a layer --first-last-layers-bf16 keeps out of FP8 (None: no FP8 layers)

    @property
    def shared_mlp(self) -> "Paths":
        """The paths the shared expert's MLP takes."""
        return self.shared or self


def _resolved(cfg: Config, kind: Optional[str]):
    """The kernel switches as the run on ``kind`` resolves them (config already resolved: as they are)."""
    import torch  # (not imported for paratron plan --help)

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
    fused SwiGLU without biases or FP8, the fused rotary attention for plain rope over whole heads. Which linears
    run in FP8 is each module's recipe (``--te-precision-config-file`` may keep some in bf16), read for a layer in
    the middle of the stack; the layers ``--first-last-layers-bf16`` keeps in bf16 take ``Paths.bf16``."""
    from ..fp8.recipe import Recipe
    m, k = cfg.model, _resolved(cfg, kind)
    recipe = Recipe.from_config(cfg.train, k)
    norm = k.kernel_rmsnorm == "quack" and m.normalization == "RMSNorm" and not m.apply_layernorm_1p \
        and m.hidden_size % 8 == 0
    flash = k.attention_backend in ("flash", "fused") and not m.multi_latent_attention
    rope = flash and not k.no_rope_fusion and m.position_embedding_type == "rope" and m.attention_dropout == 0
    layer = f"decoder.layers.{m.num_layers // 2}."
    qkv, proj = (_kept_fp8(recipe, layer + "self_attention." + name)[0] for name in ("linear_qkv", "linear_proj"))
    widths = (m.ffn_hidden_size, m.moe_shared_expert_intermediate_size or 8)  # the dense MLP's, the shared expert's
    dense = _mlp_paths(m, k, recipe, layer + "mlp.", widths[0])
    shared = _mlp_paths(m, k, recipe, layer + "mlp.shared_experts.", widths[1])
    keep = k.kernel_keep_swiglu_activation == "on"
    tiles = recipe is not None and recipe.recipe == "blockwise"

    def paths(mlp: tuple, **more) -> Paths:
        gated, fp8, fused = mlp
        return Paths(quack_norm=norm, gated_gemm=gated, keep_act=keep, fused_rope=rope, fp8_inputs=fp8,
                     fp8_mlp=fused, scan_recompute=k.kernel_linear_scan_recompute == "on", fp8_tiles=tiles, **more)
    plain = [_mlp_paths(m, k, None, "", ffn) for ffn in widths]
    bf16 = paths(plain[0], shared=None if plain[1] == plain[0] else paths(plain[1])) if recipe is not None else None
    return paths(dense, fp8_qkv=qkv, fp8_proj=proj, shared=None if shared == dense else paths(shared), bf16=bf16,
                 **(_experts_fp8(m, recipe, layer + "mlp.experts.linear_fc1") if m.num_experts else {}))


def _kept_fp8(recipe, name: str) -> tuple[bool, object]:
    """(whether the module ``name`` runs in FP8 on the per-layer path and keeps its input's FP8 copy, its recipe)."""
    r = recipe.for_module(name)[0] if recipe is not None else None
    return r is not None and r.fp8_wgrad, r


def _experts_fp8(m, recipe, name: str) -> dict:
    """The routed experts' FP8 path as their saved tensors tell it (Paths' experts_fp8, expert_align): "fused"
    (fp8/experts_mlp.py; blockwise: SwiGLU only, saving the same bytes in tiles), "layer" (the per-layer FP8 grouped
    GEMMs, fp8/experts.py), or "" where they save what bf16's do (not FP8, --no-fp8-wgrad, or hybrid on torch's
    grouped FP8 GEMM, whose backward reads the bf16 rows). Blockwise: rows in 128s."""
    from ..kernels.fp8_cast import SWIGLU
    from ..model.variants import fused_fp8_activation
    fp8, r = _kept_fp8(recipe, name)
    if not fp8 or (r.format == "hybrid" and r.grouped_gemm in ("scaled_grouped_mm", "deepgemm")):
        return {}
    act, block = fused_fp8_activation(m), r.recipe == "blockwise"
    fused = r.fuse_mlp and act is not None and m.disable_bias_linear and (not block or act == SWIGLU)
    return dict(experts_fp8="fused" if fused else "layer", **(dict(expert_align=128) if block else {}))


def _mlp_paths(m, k, recipe, prefix: str, ffn: int) -> tuple[bool, bool, bool]:
    """(quack's gated GEMMs, FP8 inputs kept, the fused FP8 MLP) of the MLP whose modules' names start ``prefix``."""
    from ..fp8 import mlp as fp8_mlp
    from ..model.variants import fused_fp8_activation
    fp8, r1 = _kept_fp8(recipe, prefix + "linear_fc1")
    _, r2 = _kept_fp8(recipe, prefix + "linear_fc2")
    swiglu = fused_fp8_activation(m) == fp8_mlp.SWIGLU
    gated = k.kernel_gated_mlp == "quack" and swiglu and m.disable_bias_linear and r1 is None and r2 is None \
        and ffn % 8 == 0
    fused = fp8 and r2 is not None and r1.recipe == r2.recipe and r1.fuse_mlp and fused_fp8_activation(m) is not None \
        and (r1.recipe != "blockwise" or swiglu and m.disable_bias_linear)  # (fp8/block_mlp.py: SwiGLU, no bias)
    return gated, fp8, fused
