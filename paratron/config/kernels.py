"""The kernel switches: one field per choice of code path (which attention kernel, which GEMM library, which
fusion), the ``kernels:`` section of a YAML file and ``--kernel-...`` flags (Megatron's own flag where one
exists: ``--attention-backend``, ``--no-rope-fusion``).

``auto`` asks for the fastest path the device, the dtype and the installed packages allow; ``on`` / a named
path asks for that path, which still steps aside (to the plain torch path) where it cannot run; ``off`` / the
plain name never takes it. The training run resolves ``auto`` into what will run before it builds the model
(paratron/kernels/switches.py), prints asked / available / runs at start-up, and the checkpoint's saved
config holds what ran. Shape conditions (a head size FlashAttention-4 has no kernel for, a width quack's
loads cannot take) are checked per module as it is built: the record says what may run, the modules run it
where it fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .section_base import Section

AUTO_ON_OFF = ("auto", "on", "off")
# the legal values of every switch (the first is the default)
CHOICES: dict[str, tuple] = {
    "attention_backend": ("auto", "flash", "fused", "unfused", "local"),
    "kernel_packed_gqa_backward": AUTO_ON_OFF,
    "kernel_decode_attention": ("auto", "triton", "fused", "fused_qkv", "sdpa"),
    "kernel_decode_gemv": ("auto", "triton", "torch"),
    "kernel_rmsnorm": ("auto", "quack", "torch"),
    "kernel_gated_mlp": ("auto", "quack", "torch"),
    "kernel_gated_mlp_wgrad": ("cublas", "quack"),
    "kernel_keep_swiglu_activation": ("on", "off"),
    "kernel_cublaslt": AUTO_ON_OFF,
    "kernel_fused_accumulate": AUTO_ON_OFF,
    "kernel_cross_entropy": ("auto", "triton", "compiled"),
    "kernel_ce_fast_exp": ("on", "off"),
    "kernel_fused_adamw": AUTO_ON_OFF,
    "kernel_fp8_fused_mlp": ("on", "off"),
    "kernel_fp8_grad_cast": ("on", "off"),
    "kernel_fp8_weight_cache": AUTO_ON_OFF,
    "kernel_fp8_block_gemm": ("auto", "scaled_mm", "deepgemm", "dequant"),
    "kernel_fp8_grouped_gemm": ("auto", "scaled_grouped_mm", "deepgemm", "dequant"),
    "kernel_fp8_block_grouped_gemm": ("auto", "deepgemm", "triton", "dequant"),
    "kernel_fp8_block_grouped_wgrad": ("auto", "triton", "dequant"),
    "kernel_fp8_block_cast": ("auto", "triton", "torch"),
    "kernel_compile_coordinate_descent": AUTO_ON_OFF,
    "kernel_decode_coordinate_descent": AUTO_ON_OFF,
    "kernel_decode_pdl": AUTO_ON_OFF,
    "kernel_moe_compile": ("layer", "experts"),
    "kernel_linear_scan": ("auto", "fla", "torch"),
    "kernel_linear_scan_recompute": ("on", "off"),
}
QUACK_TILE_USES = ("dgated", "dx", "wgrad_fc1", "wgrad_fc2")  # the gated MLP's GEMMs whose tiles can be set


@dataclass(eq=True)
class KernelConfig(Section):
    _name = "kernels"
    # Megatron's: auto | flash (FlashAttention-4 forward and backward) | fused (cuDNN's fused forward with
    # FlashAttention-4's backward) | unfused / local (torch SDPA); auto: fused where it runs, else SDPA
    attention_backend: str = "auto"  # training attention: flash (FA4) | fused (cuDNN fwd + FA4 bwd) | unfused (SDPA)
    no_rope_fusion: bool = False  # rotary embedding as torch ops, not inside the FlashAttention-4 op
    kernel_packed_gqa_backward: str = "auto"  # experimental: FA4's backward over packed grouped keys (4.0.0b10 only)
    kernel_decode_attention: str = "auto"  # over the KV cache: triton | fused (+ rotary, write) | fused_qkv | sdpa
    # the decode step's linear layers: triton (GEMV kernels at 1..8 rows, kernels/gemv.py; a one-row step's layers
    # as kernels/gemv_row.py with their norms, SwiGLU and residuals; CUDA only, refused on CPU) | torch (F.linear,
    # Inductor's reductions); auto: the row kernels at one row and torch at more on CUDA, torch on CPU
    kernel_decode_gemv: str = "auto"  # decode steps' linear layers: triton GEMV | torch (auto: triton at one row)
    kernel_rmsnorm: str = "auto"  # RMSNorm in training: quack's kernels (Hopper, bf16) | torch
    kernel_gated_mlp: str = "auto"  # SwiGLU MLP with the activation in quack's GEMM epilogues (Hopper) | torch
    kernel_gated_mlp_wgrad: str = "cublas"  # fc1's weight gradient of the gated MLP: cublas (into main_grad) | quack
    kernel_keep_swiglu_activation: str = "on"  # gated MLP: keep the activation for fc2's weight gradient
    kernel_quack_tiles: str = "default"  # gated MLP GEMM tiles: default, or use=tiles,... e.g. dx=256x128c1x2coop
    kernel_cublaslt: str = "auto"  # GEMMs by cuBLASLt's timed choice (off: torch's; auto: torch's in the paged engine)
    kernel_fused_accumulate: str = "auto"  # micro-batch gradients added into main_grad by one Triton pass
    kernel_cross_entropy: str = "auto"  # output layer's loss: one Triton pass | two compiled passes
    kernel_ce_fast_exp: str = "on"  # the cross-entropy kernel's approximate exp (off: libdevice's expf)
    kernel_fused_adamw: str = "auto"  # AdamW + the bf16 copy of the weights in one Triton pass
    kernel_fp8_fused_mlp: str = "on"  # FP8: the MLP (dense, experts) as one function writing its activation in FP8
    kernel_fp8_grad_cast: str = "on"  # FP8: output gradients cast by one kernel (off: torch ops)
    kernel_fp8_weight_cache: str = "auto"  # FP8: dense weights cast once per step of several micro-batches (auto: off)
    kernel_fp8_block_gemm: str = "auto"  # blockwise FP8 GEMMs: scaled_mm (cuBLAS) | deepgemm | dequant (bf16 GEMM)
    kernel_fp8_grouped_gemm: str = "auto"  # routed experts in FP8: scaled_grouped_mm (torch) | deepgemm | dequant
    kernel_fp8_block_grouped_gemm: str = "auto"  # blockwise FP8 experts (forward, input grad): deepgemm | triton | dequant
    kernel_fp8_block_grouped_wgrad: str = "auto"  # blockwise FP8 experts' weight gradients: triton | dequant
    kernel_fp8_block_cast: str = "auto"  # blockwise FP8 tile casts in both layouts: triton (auto on CUDA) | torch
    kernel_compile_coordinate_descent: str = "auto"  # torch.compile's coordinate-descent tuning of the layers
    kernel_decode_coordinate_descent: str = "auto"  # ... of the compiled decode step (auto: at batch size 1)
    # programmatic dependent launch in the compiled decode step (Hopper): each kernel launched while the one before
    # it finishes, waiting only where it reads that one's output (Inductor's kernels, the fused decode attention, the
    # row GEMVs, which load their first weights before they wait); auto: on at one-row steps that run the row GEMVs
    kernel_decode_pdl: str = "auto"  # decode step's kernels launched early (Hopper PDL): on | off
    kernel_moe_compile: str = "layer"  # --torch-compile's MoE layers: compiled whole with their layer | experts alone
    kernel_linear_scan: str = "auto"  # Mamba-2 / Gated DeltaNet scans: fla-core's Triton kernels (CUDA) | torch
    kernel_linear_scan_recompute: str = "on"  # torch scans: intra-chunk products recomputed in backward (less memory)


def decode_rows(gemv: str, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows runs its linear layers through the GEMV kernels, by
    ``--kernel-decode-gemv`` as it runs: triton at any row count (the kernels take 1..8), auto at one row (the row
    kernels), torch never."""
    return gemv == "triton" or (gemv == "auto" and rows == 1)


def pdl_at(pdl: str, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows launches its kernels for programmatic dependent launch, by
    ``--kernel-decode-pdl`` as it runs (auto: where the row GEMVs run, at one row)."""
    return pdl == "on" or (pdl == "auto" and rows == 1)


def asked_on(switch: str) -> bool:
    """An auto / on / off switch as a layer reads it where its auto is decided elsewhere (``--kernel-decode-pdl``:
    by the decode step's row path): on only when asked."""
    return switch == "on"


def parse_quack_tiles(spec: str) -> dict:
    """``use=tiles,...`` of --kernel-quack-tiles -> {use: tiles}; "default" -> {}. Tiles are "default",
    "off" or tile_m x tile_n, cluster m x n, ping-pong or cooperative: 256x128c1x2coop, 128x160c2x1pp."""
    out: dict = {}
    for item in filter(None, (spec or "").split(",")):
        if item.strip() == "default":
            continue
        use, _, value = (part.strip() for part in item.partition("="))
        if use not in QUACK_TILE_USES or (value not in ("default", "off") and tile_fields(value) is None):
            raise ConfigError(f"--kernel-quack-tiles {spec}: '{item}' is not <{'|'.join(QUACK_TILE_USES)}>="
                              "<default|off|TMxTNcCMxCN(pp|coop)>, e.g. dx=256x128c1x2coop")
        out[use] = value
    return out


def tile_fields(value: str) -> Optional[dict]:
    """quack's GemmConfig fields of one tile spec, "256x128c1x2coop" (tile m x n, cluster m x n, cooperative) or
    "128x160c2x1pp" (ping-pong); None when ``value`` is not one."""
    mn, sep, rest = value.partition("c")
    body = rest.removesuffix("pp").removesuffix("coop")
    parts = mn.split("x") + body.split("x")
    if not (sep and rest != body and len(parts) == 4 and all(p.isdigit() for p in parts)):
        return None
    tm, tn, cm, cn = (int(p) for p in parts)
    return dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=rest.endswith("pp"),
                is_dynamic_persistent=False)


def check_kernels(k: KernelConfig) -> None:
    """Every switch holds one of its values; the tiles parse."""
    for name, choices in CHOICES.items():
        value = getattr(k, name)
        if value not in choices:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: choose one of {', '.join(choices)}")
    parse_quack_tiles(k.kernel_quack_tiles)
