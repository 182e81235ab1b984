"""DeepSeek-V3 multi-token prediction (Megatron-core's MultiTokenPredictionBlock), ``--mtp-num-layers N``.

Depth k (1..N) predicts the token k + 1 places ahead. It takes the hidden states of depth k - 1 (depth
0: the decoder's output after its final norm; depth k >= 1: the previous depth's output after its own
final norm), the word embedding (the model's, shared) of the input tokens shifted left by k (the
positions past the end get token 0 and position 0), normalises both (``enorm`` on the embedding,
``hnorm`` on the hidden states), concatenates [embedding, hidden], projects 2h -> h (``eh_proj``, a
column-parallel linear gathered over TP), runs one transformer layer built like the decoder's last
layer (MoE when that one is), and a final norm. The shared output layer turns its output into
logits; the loss of depth k is the cross-entropy against the labels shifted left by k, averaged over
the loss mask shifted likewise (shifted-in positions masked out). ``--mtp-loss-scaling-factor`` / N
times the sum over depths joins the backward through :class:`MoEAuxLossAutoScaler` (scaled as the
main loss); the reported lm loss stays the main loss and each depth's loss is logged as ``mtp_k loss``.

``--mtp-use-repeated-layer`` (Megatron's): one MTP layer (``mtp.layers.0``) applied at every depth; an MoE
in it counts its load-balancing and z losses at 1/N per call, so the N calls add up to one layer's (Megatron
scales the aux loss so and the z loss only in its log). ``--mtp-detach-heads`` (Megatron's): the MTP
layers get the decoder's hidden states, the embeddings and the output layer's weight detached, so their
losses train the MTP layers only; the optimizer clips those layers' gradients by their own norm
(paratron/optim/groups.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import mup
from ..config import ModelConfig
from ..parallel import comm
from ..parallel.context import ContextParallel, merge_sequence, split_sequence
from ..parallel.random import checkpoint, seeded_init
from ..parallel.tensor import ColumnParallelLinear, init_normal
from .layers import Attention, ForwardContext, Norm, Parallel
from .moe import MoEAuxLossAutoScaler
from .spec import layer_specs
from .transformer import TransformerLayer


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """``t`` [b, s] shifted one place left along the sequence, the last position filled with 0."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


def _whole(t: torch.Tensor, cp: Optional[ContextParallel]) -> torch.Tensor:
    """Under context parallelism the whole sequence [b, s] of ``t`` (this rank's two chunks), gathered
    from the CP ranks once (token ids, positions, labels, masks: a few bytes a token); else ``t``."""
    if cp is None:
        return t
    parts = [torch.empty_like(t) for _ in range(cp.size)]
    dist.all_gather(parts, t.contiguous(), group=cp.group)
    return merge_sequence(parts, dim=-1)


def _mine(t: torch.Tensor, cp: Optional[ContextParallel]) -> torch.Tensor:
    """This rank's two chunks of the whole sequence ``t`` (``t`` itself without CP)."""
    return t if cp is None else split_sequence(t, cp.size, cp.rank, dim=-1)


class MTPLayer(nn.Module):
    """One prediction depth; parameter names are Megatron's (``mtp.layers.{k}.enorm.weight``, ...)."""

    def __init__(self, cfg: ModelConfig, par: Parallel, depth: int, device=None, dtype=None):
        super().__init__()
        self.par = par
        h, sp = cfg.hidden_size, par.sequence_parallel
        self.enorm = Norm.of(cfg, h, sp, device, dtype, par.kernels)
        self.hnorm = Norm.of(cfg, h, sp, device, dtype, par.kernels)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp_group=par.tp_group, bias=False, gather_output=True,
                                            sequence_parallel=sp, init_method=init_normal(mup.hidden_std(cfg)),
                                            device=device, dtype=dtype)
        # The decoder's last layer's kind (dense or MoE), numbered after the decoder's layers.
        spec = dataclasses.replace(layer_specs(cfg)[-1], index=cfg.num_layers + depth)
        self.mtp_model_layer = TransformerLayer(cfg, par, spec, device, dtype)
        self.final_layernorm = Norm.of(cfg, h, sp, device, dtype, par.kernels)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [s, b, h], gathered
        if self.par.sequence_parallel:
            x = comm.scatter_to_sp(x, self.par.tp_group)
        return self.final_layernorm(self.mtp_model_layer(x, ctx))


class MultiTokenPrediction(nn.Module):
    """The N depths (``mtp.layers``), their losses' backward scale and their logged losses."""

    def __init__(self, cfg: ModelConfig, par: Parallel, seed: Optional[int] = None, recompute: Optional[str] = None,
                 device=None, dtype=None):
        super().__init__()
        self.par, self.recompute, self.depths, self.detach = par, recompute, cfg.mtp_num_layers, cfg.mtp_detach_heads
        built = 1 if cfg.mtp_use_repeated_layer else self.depths
        if cfg.mtp_use_repeated_layer and cfg.num_experts is not None:  # its MoE's losses: 1/N per call
            z = cfg.moe_z_loss_coeff
            cfg = dataclasses.replace(cfg, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff / self.depths,
                                      moe_z_loss_coeff=None if z is None else z / self.depths)
        layers = []
        for k in range(built):
            with seeded_init(seed, f"mtp{k}", device):
                layers.append(MTPLayer(cfg, par, k, device, dtype))
        self.layers = nn.ModuleList(layers)
        for layer in self.layers:  # selective recomputation of the attention core, as the decoder's
            attention = layer.mtp_model_layer.self_attention
            if isinstance(attention, Attention) or hasattr(attention, "recompute_core"):
                attention.recompute_core = recompute == "selective"
        self.scaling = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
        self.loss_scale = 1.0  # the backward scale of the MTP loss (the training loop sets it; see before_step)
        self.per_token_loss = False  # --calculate-per-token-loss: sums (re-weighted to the main loss's tokens)
        self.metrics: Optional[torch.Tensor] = None  # [depth, (sum of micro-batch losses, count)], on the device

    def _layer(self, layer: MTPLayer, hidden, embedded, ctx):
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return checkpoint(layer, hidden, embedded, ctx, rng=self.par.trackers())
        return layer(hidden, embedded, ctx)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                ctx: ForwardContext, embedding: Callable) -> list[torch.Tensor]:
        """The output hidden states of each depth (``hidden``: the decoder's, after its final norm)."""
        outputs = []
        ids, pos = _whole(input_ids, ctx.cp), _whole(position_ids, ctx.cp)  # shifted whole, used as this rank's
        hidden = hidden.detach() if self.detach else hidden  # --mtp-detach-heads: nothing flows back to the model
        for k in range(self.depths):
            layer = self.layers[k % len(self.layers)]  # --mtp-use-repeated-layer: layer 0 at every depth
            ids, pos = roll_left(ids), roll_left(pos)
            embedded = embedding(_mine(ids, ctx.cp), _mine(pos, ctx.cp))
            hidden = self._layer(layer, hidden, embedded.detach() if self.detach else embedded, ctx)
            outputs.append(hidden)
        return outputs

    def _track(self, k: int, loss: torch.Tensor) -> None:
        if self.metrics is None:
            self.metrics = torch.zeros(self.depths, 2, device=loss.device)
        self.metrics[k, 0] += loss
        self.metrics[k, 1] += 1

    def attach_loss(self, output: torch.Tensor, hiddens: list, labels: torch.Tensor,
                    loss_mask: Optional[torch.Tensor], token_losses: Callable,
                    cp: Optional[ContextParallel] = None) -> torch.Tensor:
        """``output`` (the main per-token loss) carrying the MTP loss into the backward.
        ``token_losses(hidden, labels, detach_weight)``: per-token cross-entropy [b, s] through the shared
        output layer (its weight detached with --mtp-detach-heads).
        Under context parallelism (``cp``) the token counts are the CP group's and this rank's loss is its
        share times CP, as the main loss (the gradient average over DP x CP divides by CP); with
        --calculate-per-token-loss the gradients are summed instead, so the share is not multiplied."""
        parts = cp.size if cp is not None else 1
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        labels, mask = _whole(labels, cp), _whole(mask, cp)  # token counts of the whole sequence
        original_tokens = mask.sum()
        for k, hidden in enumerate(hiddens):
            labels, mask = roll_left(labels), roll_left(mask)
            n = mask.sum().clamp(min=1)
            total = (token_losses(hidden, _mine(labels, cp), self.detach).float() * _mine(mask, cp)).sum()
            if self.training:
                self._track(k, (total * parts / n).detach())  # the mean over the CP ranks is the loss
            loss = total * (original_tokens / n) if self.per_token_loss else total * parts / n
            output = MoEAuxLossAutoScaler.apply(output, self.scaling * loss, self.loss_scale)
        return output


def build(cfg: ModelConfig, par: Parallel, whole_model: bool, seed: Optional[int], recompute: Optional[str], fp8,
          device=None, dtype=None) -> Optional[MultiTokenPrediction]:
    """The MTP block of a model with --mtp-num-layers (None without); ``whole_model``: this chunk holds the
    embedding and the output layer (pipeline size 1). ``fp8``: the decoder's FP8 recipe, for its layer too."""
    if not cfg.mtp_num_layers:
        return None
    if not whole_model:
        raise ValueError("multi-token prediction needs the embedding and the output layer on one stage (pipeline "
                         "size 1)")
    from .. import fp8 as fp8_mod
    block = MultiTokenPrediction(cfg, par, seed, recompute, device, dtype)
    fp8_mod.attach(block, fp8, prefix="mtp")
    return block


# ---- what the training loop does with the MTP block ------------------------------------------------

def blocks(models) -> list[MultiTokenPrediction]:
    return [m for chunk in models for m in chunk.modules() if isinstance(m, MultiTokenPrediction)]


def before_step(mtp_blocks: list, loss_scale, num_microbatches: int, per_token_loss: bool) -> None:
    """The MTP loss's backward scale for the next step: the main loss's (Megatron's MTPLossAutoScaler)."""
    for b in mtp_blocks:
        b.loss_scale = loss_scale if per_token_loss else loss_scale / num_microbatches
        b.per_token_loss = per_token_loss


def take_metrics(mtp_blocks: list, num_layers: int, device, reduce: bool) -> dict:
    """``{"mtp_k loss": value}`` since the last call (sums reset): each depth's loss averaged over the
    micro-batches and steps (and, with ``reduce``, over every rank: one collective every rank joins)."""
    sums = torch.zeros(num_layers, 2, device=device)
    for b in mtp_blocks:
        if b.metrics is not None:
            sums += b.metrics.to(device)
            b.metrics.zero_()
    if reduce:
        torch.distributed.all_reduce(sums)
    return {f"mtp_{k + 1} loss": (sums[k, 0] / sums[k, 1]).item() for k in range(num_layers) if sums[k, 1] > 0}
