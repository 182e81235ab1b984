"""The pre-norm transformer block and the stack of blocks (activation recomputation lives here)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config.kernels import pdl_at
from ..kernels import gemv_row
from ..parallel.random import checkpoint, seeded_init
from . import activation_offload as offload, recompute
from .layers import MLP, Attention, ForwardContext, Norm, Parallel
from .spec import LayerSpec, build_mixer, build_mlp, layer_specs


class TransformerLayer(nn.Module):
    """Layer ``spec.index`` of the decoder, pre-norm: x + mixer(norm(x)), then x + mlp(norm(x)). The
    mixer (``self_attention``) and the MLP are built from the spec; a hybrid layer has only one of
    them (the other and its norm are None)."""

    def __init__(self, cfg: ModelConfig, par: Parallel, spec: LayerSpec, device=None, dtype=None):
        super().__init__()
        self.par, self.p, self.index = par, cfg.hidden_dropout, spec.index
        self.fuse_residual = not cfg.no_bias_dropout_fusion

        def norm():
            return Norm.of(cfg, cfg.hidden_size, par.sequence_parallel, device, dtype, par.kernels)

        self.input_layernorm = norm() if spec.mixer is not None else None
        self.self_attention = build_mixer(spec, cfg, par, device, dtype)
        self.pre_mlp_layernorm = norm() if spec.mlp is not None else None
        self.mlp = build_mlp(spec, cfg, par, device, dtype)
        self.recompute_norms = self.recompute_mlp = False  # --recompute-modules layernorm / mlp, moe (recompute.py)
        self.decode_rows = self._rows_fuse()  # a one-row decode step through the GEMV kernels: decode_row
        self.decode_pdl = pdl_at(par.kernels.kernel_decode_pdl, 1)

    def _rows_fuse(self) -> bool:
        """Whether ``decode_row`` takes this layer: self-attention that fuses its decode attention, a dense SwiGLU
        MLP, RMSNorms, no biases but qkv's (Qwen2's ``--add-qkv-bias``), one TP rank."""
        a, m = self.self_attention, self.mlp
        if type(a) is not Attention or type(m) is not MLP or not (a.fused_decode and m.gemv_swiglu):
            return False
        norms = (self.input_layernorm, self.pre_mlp_layernorm)
        linears = (a.linear_proj, m.linear_fc1, m.linear_fc2)
        return (self.par.tp_size == 1 and all(n.plain_rms for n in norms)
                and all(lin.bias is None for lin in linears))

    def decode_row(self, x: torch.Tensor, ctx: ForwardContext) -> Optional[torch.Tensor]:
        """The layer at one row of a decode step as four GEMV kernels around the fused attention
        (kernels/gemv_row.py): the norm and qkv, the output projection and the residual, the norm, fc1 and SwiGLU,
        fc2 and the residual. None where the layer takes the per-module path (FP8 linears, a step the fused
        attention does not take)."""
        a, m, norm, mlp_norm = self.self_attention, self.mlp, self.input_layernorm, self.pre_mlp_layernorm
        if any(lin.fp8 is not None for lin in (a.linear_qkv, a.linear_proj, m.linear_fc1, m.linear_fc2)) \
                or not a.decodes_fused(x, ctx):
            return None
        pdl = self.decode_pdl
        attended = a.decode_qkv_attention(x, norm, ctx, pdl)  # (--kernel-decode-attention fused_qkv: one kernel)
        if attended is None:
            qkv = gemv_row.linear(x, a.linear_qkv.weight, norm.weight, eps=norm.eps, pdl=pdl, bias=a.linear_qkv.bias)
            attended = a.decode_attention(qkv, ctx, pdl)
        h = gemv_row.linear(attended, a.linear_proj.weight, residual=x, pdl=pdl)
        act = gemv_row.linear(h, m.linear_fc1.weight, mlp_norm.weight, gated=True, eps=mlp_norm.eps, pdl=pdl)
        return gemv_row.linear(act, m.linear_fc2.weight, residual=h, pdl=pdl)

    def _dropout_off(self) -> bool:
        return not self.training or self.p == 0.0

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self._dropout_off():
            return x
        if self.par.sequence_parallel:  # sequence-sharded: each rank draws its own mask
            with self.par.fork():
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)

    def _normed(self, norm, x: torch.Tensor, then, point: str = "attn_norm"):
        """``then(norm(x))``; with --recompute-modules layernorm the norm's output is not kept for backward;
        ``point``: the norm's name for --offload-modules (model/activation_offload.py)."""
        if self.recompute_norms and recompute.active(self):
            return recompute.discard_output(norm, x, then)
        with offload.at(self, point):
            h = norm(x)
        return then(h)

    def _normed_residual(self, norm, x: torch.Tensor, then, point: str = "attn_norm"):
        """``then(norm(x), x)``, x being the residual ``then`` adds (Norm.keep: on quack's kernel the norm's
        backward then also adds the residual's gradient)."""
        if self.recompute_norms and recompute.active(self):
            return recompute.discard_output(norm, x, lambda h: then(h, x))
        with offload.at(self, point):
            h, x = norm.keep(x)
        return then(h, x)

    def _mlp(self, h: torch.Tensor, residual: Optional[torch.Tensor] = None, gemv: bool = False) -> torch.Tensor:
        """``gemv``: a decode step's linear layers through kernels/gemv.py (``ForwardContext.gemv``), in an MLP
        that takes it."""
        if gemv and getattr(self.mlp, "takes_gemv", False):
            return self.mlp(h, residual, gemv=True)
        if self.recompute_mlp and recompute.active(self):  # --recompute-modules mlp / moe
            return checkpoint(self.mlp, h, residual, rng=self.par.rng)
        return self.mlp(h, residual)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.gemv and self.decode_rows and x.size(0) * x.size(1) == 1:
            out = self.decode_row(x, ctx)
            if out is not None:
                return out
        if ctx.gemv and ctx.gemv_rows_only:  # this layer's linears keep torch's path
            ctx = dataclasses.replace(ctx, gemv=False)
        return self._feed(self._mix(self.input_layernorm, self.self_attention, x, ctx), ctx.gemv)

    def _mix(self, norm, mixer, x: torch.Tensor, *args) -> torch.Tensor:
        """``x + mixer(norm(x), *args)``: the residual added by the mixer's output projection where it takes one
        (the decoder's cross-attention shares this with self-attention)."""
        if mixer is None:
            return x
        if self.fuse_residual and self._dropout_off() and getattr(mixer, "takes_residual", False):
            return self._normed_residual(norm, x, lambda h, r: mixer(h, *args, r))
        return x + self._dropout(self._normed(norm, x, lambda h: mixer(h, *args)))

    def _feed(self, x: torch.Tensor, gemv: bool = False) -> torch.Tensor:
        """``x + mlp(norm(x))`` (x itself in a layer without an MLP); ``gemv``: see ``_mlp``."""
        if self.mlp is None:
            return x
        mlp = (lambda h, r=None: self._mlp(h, r, gemv=True)) if gemv else self._mlp
        if self.fuse_residual and self._dropout_off():  # the output projections' matmuls add the residual
            return self._normed_residual(self.pre_mlp_layernorm, x, mlp, "mlp_norm")
        return x + self._dropout(self._normed(self.pre_mlp_layernorm, x, mlp, "mlp_norm"))


class TransformerStack(nn.Module):
    """Layers [layer_offset, layer_offset + len(layers)) of the decoder, plus the final norm on the
    last pipeline stage."""

    def __init__(self, cfg: ModelConfig, par: Parallel, num_layers: int, layer_offset: int = 0,
                 final_norm: bool = True, recompute_granularity: Optional[str] = None,
                 recompute_method: Optional[str] = None, recompute_num_layers: Optional[int] = None,
                 device=None, dtype=None, seed: Optional[int] = None):
        """``seed``: draw each layer's initial weights from its own stream, named by its global index
        (what makes a pipeline stage's layers those of the one-stage model); None: the global RNG."""
        super().__init__()
        self.par, self.layer_offset = par, layer_offset
        layers = []
        for spec in layer_specs(cfg)[layer_offset:layer_offset + num_layers]:
            with seeded_init(seed, f"layer{spec.index}", device) if seed is not None else contextlib.nullcontext():
                layers.append(TransformerLayer(cfg, par, spec, device, dtype))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = (Norm.of(cfg, cfg.hidden_size, par.sequence_parallel, device, dtype, par.kernels)
                                if final_norm else None)
        self.recompute = recompute_granularity
        for layer in self.layers:  # selective: keep the matmul outputs, recompute the attention core
            if isinstance(layer.self_attention, Attention) or hasattr(layer.self_attention, "recompute_core"):
                layer.self_attention.recompute_core = recompute_granularity == "selective"
        self.recompute_method = recompute_method
        self.recompute_num_layers = recompute_num_layers or 1

    def _run(self, layers, x, ctx: ForwardContext):
        for layer in layers:
            x = layer(x, ctx)
        return x

    def forward(self, x: torch.Tensor, ctx: ForwardContext, final_norm: bool = True) -> torch.Tensor:
        """``final_norm``: False leaves the final norm to the caller (a decode step's output layer fuses it)."""
        n = len(self.layers)
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            k = self.recompute_num_layers
            if self.recompute_method == "uniform":  # checkpoint every chunk of k layers
                for i in range(0, n, k):
                    x = checkpoint(self._run, self.layers[i:i + k], x, ctx, rng=self.par.trackers())
            else:  # block: checkpoint each of the first k layers, run the rest normally
                for i, layer in enumerate(self.layers):
                    x = checkpoint(layer, x, ctx, rng=self.par.trackers()) if i < k else layer(x, ctx)
        else:
            x = self._run(self.layers, x, ctx)
        return self.final_layernorm(x) if self.final_layernorm is not None and final_norm else x
