"""The kernel switches resolved for a run: each ``auto`` of the ``kernels`` config section (config/kernels.py)
becomes the path that will run on this device, in this dtype, with the packages installed; an explicit choice
stays as asked. ``table`` gives what was asked, what is available and what runs, for the start-up lines and
the docs. The training run stores the resolved record in its config, so the checkpoint says what trained the
model."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..config.kernels import CHOICES, KernelConfig
from ..errors import ConfigError
from . import flash_attention, fp8_block, fp8_block_grouped, fp8_grouped, fused_adamw, linear_scan, quack_mlp, quack_norm
from .experimental import deepgemm, flash_packed
from .hardware import launches_dependent

try:
    import triton  # noqa: F401
    _TRITON = True
except ImportError:
    _TRITON = False


# switches whose ``auto`` stays ``auto`` after resolution: decided per call (the decode step's batch size)
STAYS_AUTO = frozenset({"kernel_decode_coordinate_descent", "kernel_decode_gemv", "kernel_decode_pdl"})


def device_resolved(k: KernelConfig) -> bool:
    """Whether ``k`` holds what runs (``resolve``'s answer for a device): no ``auto`` left but the per-call ones."""
    return not any(getattr(k, f.name) == "auto" for f in dataclasses.fields(KernelConfig) if f.name not in STAYS_AUTO)


def offer(device, dtype) -> dict:
    """What ``device`` in ``dtype`` offers the optional kernels, with the packages installed here."""
    cuda = torch.device(device).type == "cuda"
    fa4 = flash_attention.available(device, dtype)
    return dict(cuda=cuda, fa4=fa4, quack=quack_mlp.available(device, dtype),
                quack_norm=quack_norm.available(device, dtype), packed=fa4 and flash_packed.pinned(),
                triton_gpu=cuda and _TRITON, fused_adamw=fused_adamw.available(device),
                pdl=launches_dependent(device) and _TRITON)


def offer_of_kind(hopper_bf16: bool, cuda: bool = True) -> dict:
    """What a GPU offers the optional kernels with ``paratron[hopper]`` installed (FlashAttention-4, quack,
    Triton), without the device at hand: what ``paratron plan`` assumes of a GPU kind (``hopper_bf16``: a Hopper
    GPU and a bf16 model). The packed grouped-key backward (one pinned flash-attn-4 version) is taken as absent."""
    return dict(cuda=cuda, fa4=hopper_bf16, quack=hopper_bf16, quack_norm=hopper_bf16, packed=False,
                triton_gpu=cuda, fused_adamw=cuda, pdl=cuda and hopper_bf16)


def availability(device, dtype, deterministic: bool = False, offered: Optional[dict] = None) -> dict:
    """{switch: (what ``auto`` resolves to, why)} for a model on ``device`` in ``dtype`` (``offered``: what the
    device offers, default ``offer(device, dtype)``; the FP8 GEMMs' and the scans' choices read ``device``)."""
    o = offered or offer(device, dtype)
    cuda, fa4, quack, packed, triton_gpu = o["cuda"], o["fa4"], o["quack"], o["packed"], o["triton_gpu"]
    why_fa4 = "FlashAttention-4 on Hopper in bf16" if fa4 else "needs flash-attn-4 (paratron[hopper]), Hopper, bf16"
    why_quack = "quack-kernels on Hopper in bf16" if quack else "needs quack-kernels (paratron[hopper]), Hopper, bf16"
    return {
        "attention_backend": ("fused" if fa4 and not deterministic else "unfused",
                              "deterministic mode: SDPA" if fa4 and deterministic else why_fa4),
        "no_rope_fusion": (not fa4, why_fa4),
        "kernel_packed_gqa_backward": ("on" if packed else "off",
                                       f"flash-attn-4 {flash_packed.VERSION} on Hopper" if packed
                                       else f"needs flash-attn-4 {flash_packed.VERSION} exactly, Hopper, bf16"),
        "kernel_decode_attention": ("fused" if triton_gpu else "sdpa",
                                    "Triton on CUDA; one row in bf16 / fp16: the rotary embedding, cache write and "
                                    "attention in one kernel (measured faster, docs/inference.md)" if triton_gpu
                                    else "needs Triton and CUDA"),
        "kernel_decode_gemv": ("auto", "one-row decode steps through the row GEMVs (measured faster, "
                               "docs/inference.md); more rows through Inductor's") if triton_gpu
        else ("torch", "needs Triton and CUDA"),
        "kernel_rmsnorm": ("quack" if o["quack_norm"] else "torch", why_quack),
        "kernel_gated_mlp": ("quack" if quack else "torch", why_quack),
        "kernel_cublaslt": ("on" if cuda and not deterministic else "off",
                            "deterministic mode: its timed choice could differ between runs" if deterministic
                            else "cuBLASLt on CUDA in bf16" if cuda else "CUDA only"),
        "kernel_fused_accumulate": ("on" if triton_gpu else "off", "Triton on CUDA" if triton_gpu
                                    else "needs Triton and CUDA"),
        "kernel_cross_entropy": ("triton" if triton_gpu else "compiled", "Triton on CUDA" if triton_gpu
                                 else "needs Triton and CUDA"),
        "kernel_fused_adamw": ("on" if o["fused_adamw"] else "off",
                               "Triton on CUDA" if o["fused_adamw"] else "needs Triton and CUDA"),
        "kernel_fp8_block_gemm": fp8_block.gemm_choice(device),
        "kernel_fp8_grouped_gemm": fp8_grouped.gemm_choice(device),
        "kernel_fp8_block_grouped_gemm": fp8_block_grouped.gemm_choice(device),
        "kernel_fp8_block_grouped_wgrad": fp8_block_grouped.wgrad_choice(device),
        "kernel_fp8_weight_cache": ("off", "measured slower than each layer's own casts (docs/performance.md)"),
        "kernel_fp8_block_cast": ("triton", "Triton on CUDA: one read of each blockwise operand for both layouts")
        if triton_gpu else ("torch", "needs Triton and CUDA"),
        "kernel_compile_coordinate_descent": ("on" if cuda else "off", "CUDA: Inductor's Triton kernels tuned"
                                              if cuda else "CUDA only"),
        "kernel_decode_coordinate_descent": ("auto", "tuned at batch 1 only (the one-row matmuls)"),
        "kernel_decode_pdl": ("auto", "on at one-row steps with the row GEMVs (measured faster, docs/inference.md); "
                              "off with --kernel-decode-gemv torch")
        if o["pdl"] and triton_gpu else ("off", "needs Hopper, Triton and CUDA"),
        "kernel_linear_scan": _linear_scan(device),
    }


def _linear_scan(device) -> tuple[str, str]:
    if linear_scan.fla_available(device):
        return "fla", "fla-core's Triton kernels on CUDA"
    refusal = linear_scan.fla_refusal() if torch.device(device).type == "cuda" and linear_scan.fla_installed() else None
    return "torch", refusal.split(": install")[0] if refusal else "needs fla-core and CUDA"


def resolve(asked: KernelConfig, device, dtype, deterministic: bool = False,
            offered: Optional[dict] = None) -> KernelConfig:
    """A copy of ``asked`` with every ``auto`` replaced by what runs here (``no_rope_fusion``: set where the
    fused rotary attention cannot run); ``offered``: see ``availability``."""
    if asked.kernel_linear_scan == "fla" and torch.device(device).type == "cuda" and linear_scan.fla_refusal():
        raise ConfigError(f"--kernel-linear-scan fla: {linear_scan.fla_refusal()}")
    if asked.kernel_decode_gemv == "triton" and not (offered or offer(device, dtype))["triton_gpu"]:
        raise ConfigError("--kernel-decode-gemv triton: the GEMV kernel needs Triton and a CUDA device "
                          "(choose torch or auto here)")
    for name in ("kernel_fp8_block_grouped_gemm", "kernel_fp8_block_grouped_wgrad"):
        if getattr(asked, name) == "triton" and not (offered or offer(device, dtype))["triton_gpu"]:
            raise ConfigError(f"--{name.replace('_', '-')} triton: the kernel needs Triton and a CUDA device "
                              "(choose dequant or auto here)")
    why = deepgemm.refusal(device)
    for name in ("kernel_fp8_block_gemm", "kernel_fp8_grouped_gemm", "kernel_fp8_block_grouped_gemm"):
        if getattr(asked, name) == "deepgemm" and why:
            raise ConfigError(f"--{name.replace('_', '-')} deepgemm: {why} (choose auto here)")
    if asked.kernel_fp8_block_cast == "triton" and not (offered or offer(device, dtype))["triton_gpu"]:
        raise ConfigError("--kernel-fp8-block-cast triton: the kernel needs Triton and a CUDA device "
                          "(choose torch or auto here)")
    found = availability(device, dtype, deterministic, offered)
    changes = {name: found[name][0] for name in found
               if name != "no_rope_fusion" and getattr(asked, name) == "auto"}
    if found["no_rope_fusion"][0]:
        changes["no_rope_fusion"] = True
    gemv = changes.get("kernel_decode_gemv", asked.kernel_decode_gemv)
    if changes.get("kernel_decode_pdl") == "auto" and gemv == "torch":
        changes["kernel_decode_pdl"] = "off"  # (launched early, Inductor's kernels alone measured slower)
    out = dataclasses.replace(asked.unfrozen() if asked.is_resolved else asked, **changes)
    return out


def table(asked: KernelConfig, runs: KernelConfig, found: Optional[dict] = None) -> list[tuple]:
    """(flag, asked, runs, why) per switch, in the section's order."""
    found = found or {}
    rows = []
    for f in dataclasses.fields(KernelConfig):
        why = found.get(f.name, ("", ""))[1]
        rows.append((f"--{f.name.replace('_', '-')}", getattr(asked, f.name), getattr(runs, f.name), why))
    return rows


def startup_lines(asked: KernelConfig, runs: KernelConfig, device, dtype, deterministic: bool = False) -> list[str]:
    """The start-up lines: every switch as asked -> as it runs (``runs``: ``resolve``'s answer), and why where
    ``auto`` decided."""
    found = availability(device, dtype, deterministic)
    lines = [" kernel switches (asked -> runs; config/kernels.py):"]
    for flag, a, r, why in table(asked, runs, found):
        note = f"  [{why}]" if a != r and why else ""
        lines.append(f"   {flag} {a}" + (f" -> {r}" if a != r else "") + note)
    return lines


def choices_markdown(help_of=None) -> str:
    """The switches as a Markdown table (flag, YAML key under ``kernels:``, values with the default first, what
    it chooses) for docs/performance.md; ``help_of(name)``: a field's one-line help (config/help.py)."""
    out = ["| flag | values (default first) | chooses |", "|---|---|---|"]
    for f in dataclasses.fields(KernelConfig):
        values = CHOICES.get(f.name)
        default = getattr(KernelConfig(), f.name)
        shown = " / ".join(values) if values else f"{default} (default)" if not isinstance(default, bool) \
            else "false / true"
        what = help_of(f.name).replace("|", "/") if help_of else ""
        out.append(f"| `--{f.name.replace('_', '-')}` | {shown} | {what} |")
    return "\n".join(out) + "\n"


def write_switches_table(text: str, table: str) -> str:
    """``text`` (docs/performance.md) with ``table`` between its switches markers."""
    begin, end = "<!-- switches:begin -->\n", "<!-- switches:end -->"
    head, rest = text.split(begin, 1)
    return head + begin + table + end + rest.split(end, 1)[1]
