"""The dense MLP (fc1 -> activation -> fc2) and the scaled init of the projections into the residual stream."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import mup
from ..config import ModelConfig
from ..config.kernels import parse_quack_tiles
from ..fp8 import mlp as fp8_mlp
from ..kernels import gemv as gemv_kernel, quack_mlp
from ..kernels.swiglu import swiglu, swiglu_reference
from ..parallel import comm
from ..parallel.linear import main_grad_of, mark_fusable
from ..parallel.tensor import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, init_normal
from .context import Parallel
from .variants import fused_fp8_activation, is_gated, mlp_activation


def output_init(cfg: ModelConfig):
    """Megatron's scaled init for the projections that feed the residual stream."""
    return init_normal(mup.hidden_std(cfg) / math.sqrt(2.0 * cfg.num_layers))


def latent_projections(cfg: ModelConfig, split: bool, device=None, dtype=None) -> tuple:
    """--moe-latent-size: (hidden -> latent before the routed experts, latent -> hidden after them), each
    replicated over TP (``split``: each TP rank routes a share of the tokens, so their gradients are summed
    over TP), with biases unless --disable-bias-linear (Megatron's fc1/fc2_latent_proj); (None, None) without."""
    latent, h, bias = cfg.moe_latent_size, cfg.hidden_size, not cfg.disable_bias_linear
    if latent is None:
        return None, None
    return (ReplicatedLinear(h, latent, init_normal(mup.hidden_std(cfg)), split, device, dtype, bias),
            ReplicatedLinear(latent, h, output_init(cfg), split, device, dtype, bias))


class MLP(nn.Module):
    takes_gemv = True  # forward(x, residual, gemv=True): a decode step's linear layers through kernels/gemv.py

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None):
        super().__init__()
        bias = not cfg.disable_bias_linear
        gated = is_gated(cfg)
        self.activation = mlp_activation(cfg)
        self.fp8_act = fused_fp8_activation(cfg)  # the fused FP8 MLP's activation code (None: per layer)
        # fc1 -> SwiGLU -> fc2 as two GEMMs with the activation in their epilogues (Hopper, quack;
        # --kernel-gated-mlp): None, or the library of fc1's backward GEMMs
        k = par.kernels
        self.gated_gemm = (quack_mlp.wanted(self.fp8_act == fp8_mlp.SWIGLU, bias, device, dtype,
                                            k.kernel_gated_mlp_wgrad) if k.kernel_gated_mlp != "torch" else None)
        self.keep_act = k.kernel_keep_swiglu_activation == "on"
        self.tiles = quack_mlp.tile_pairs(parse_quack_tiles(k.kernel_quack_tiles)) if self.gated_gemm else None
        # a decode step's SwiGLU of fc1's [gate; up] halves in the GEMV kernel's epilogue (plain SwiGLU only)
        self.gemv_swiglu = cfg.swiglu and self.activation in (swiglu, swiglu_reference)
        width = cfg.ffn_hidden_size * (2 if gated else 1)
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, width, tp_group=par.tp_group, bias=bias,
                                               sequence_parallel=par.sequence_parallel,
                                               chunks=2 if gated else 1,
                                               init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group=par.tp_group, bias=bias,
                                            sequence_parallel=par.sequence_parallel, init_method=output_init(cfg),
                                            device=device, dtype=dtype)
        # their weight gradients may go straight into main_grad (the plain path's linear layers and the gated
        # GEMMs' backward honour it; fc1's only with its backward GEMMs on cuBLAS); of the FP8 paths only the
        # blockwise recipe's (its linear and fused MLP) take main_grad: DataParallel leaves the others unfused
        mark_fusable(self.linear_fc2, *(() if self.gated_gemm == "quack" else (self.linear_fc1,)))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, gemv: bool = False) -> torch.Tensor:
        """``residual`` is added to the output (by fc2's matmul where it can); ``gemv``: a decode step under
        ``--kernel-decode-gemv triton`` (``ForwardContext.gemv``)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if gemv and fc1.fp8 is None and fc2.fp8 is None:
            return self._gemv(x, residual)
        if fp8_mlp.applies(fc1, fc2, self.fp8_act):  # the activation's output and gradient born in FP8
            return fc2.exit(fp8_mlp.fused_mlp(fc1.enter(x), fc1.weight, fc1.bias, fc2.weight, fc1.fp8, fc2.fp8,
                                              self.fp8_act, self._main_grads()), residual)
        if self.gated_gemm and quack_mlp.applies(x, fc1, fc2):
            tp1 = comm.group_size(fc2.tp_group) == 1  # fc2's GEMM adds the residual (not to a TP partial sum)
            y = quack_mlp.gated_mlp(fc1.enter(x), fc1.weight, fc2.weight, residual if tp1 else None,
                                    bwd=self.gated_gemm, main_grads=self._main_grads(), keep_act=self.keep_act,
                                    tiles=self.tiles, cublaslt=fc2.cublaslt)
            return fc2.exit(y, None if tp1 else residual)
        return fc2(self.activation(fc1(x)), residual)

    def _main_grads(self) -> tuple:
        """(fc1's, fc2's) float32 gradient buffers where DataParallel fuses the weight gradients, else Nones."""
        return main_grad_of(self.linear_fc1.weight), main_grad_of(self.linear_fc2.weight)

    def _gemv(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The decode step's MLP through the GEMV kernel: SwiGLU in fc1's epilogue where the activation is plain
        SwiGLU (kernels/gemv.py falls back to torch where it cannot run)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if self.gemv_swiglu:
            h = gemv_kernel.swiglu(fc1.enter(x), fc1.weight, fc1.bias)
        else:
            h = self.activation(fc1(x, gemv=True))
        return fc2(h, residual, gemv=True)
