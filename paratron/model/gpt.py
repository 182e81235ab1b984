"""The decoder-only language model: GPT-2/3 and Llama / Mistral / Qwen2 by configuration.

Parameter names are Megatron-core's (``embedding.word_embeddings.weight``,
``decoder.layers.0.self_attention.linear_qkv.weight``, ...); ``paratron/checkpoint/hf.py`` maps them to
Hugging Face names with a fixed table.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..config.kernels import KernelConfig
from ..parallel import comm
from .. import fp8 as fp8_mod
from ..parallel.context import ContextParallel, document_causal_mask
from ..parallel.dims import ParallelDims
from ..parallel.linear import mark_fusable
from ..parallel.random import EXPERT_SEED_OFFSET, RNGTracker, seeded_init
from ..parallel.sharding import update_spec
from ..parallel.tensor import (ColumnParallelLinear, VocabParallelEmbedding, init_normal, linear_cross_entropy,
                               set_cublaslt, vocab_parallel_cross_entropy)
from .layers import ForwardContext, Parallel, Rotary
from . import mup
from .mla import MLARotary
from .mtp import build as build_mtp
from .transformer import TransformerStack

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    """Word (+ learned absolute position) (+ tokentype) embeddings, then dropout (Megatron-core's
    LanguageModelEmbedding). ``num_tokentypes`` > 0 adds ``tokentype_embeddings`` [num_tokentypes, h] (BERT's
    segment A / B), drawn after the other tables from the same stream, so a model without it is unchanged."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, par: Parallel, device=None, dtype=None,
                 num_tokentypes: int = 0):
        super().__init__()
        self.par, self.p = par, cfg.hidden_dropout
        self.mult = cfg.mup_embedding_mult if cfg.use_mup else 1.0  # muP's embedding multiplier
        init = init_normal(embedding_std(cfg))
        self.word_embeddings = VocabParallelEmbedding(vocab_size, cfg.hidden_size, tp_group=par.tp_group,
                                                      init_method=init, device=device, dtype=dtype)
        if cfg.untie_embeddings_and_output_weights:  # (tied, the output layer's matmul uses the table too)
            mark_fusable(self.word_embeddings)  # its gradient may go into main_grad directly
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, device=device,
                                                    dtype=dtype)
            init(self.position_embeddings.weight.data)
        else:
            self.position_embeddings = None
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = nn.Embedding(num_tokentypes, cfg.hidden_size, device=device, dtype=dtype)
            init(self.tokentype_embeddings.weight.data)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids / position_ids / tokentype_ids [b, s] -> [s(/TP with SP), b, h]; ``tokentype_ids`` are
        required when the embedding has tokentypes (and refused when it has none)."""
        # looked up in [s, b] order: the rows come out sequence-first, with no transposing copy forward and
        # no contiguous copy of the gradient in the embedding's backward
        x = self.word_embeddings(input_ids.t())  # [s, b, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids.t())
        if (tokentype_ids is None) != (self.tokentype_embeddings is None):
            raise ValueError("tokentype_ids are given exactly when the embedding has tokentypes (num_tokentypes > 0)")
        if tokentype_ids is not None:
            x = x + self.tokentype_embeddings(tokentype_ids.t())
        if self.mult != 1.0:
            x = x * self.mult
        if self.par.sequence_parallel:
            x = comm.scatter_to_sp(x, self.par.tp_group)
            with self.par.fork():
                return F.dropout(x, self.p, self.training)
        return F.dropout(x, self.p, self.training)


def embedding_std(cfg: ModelConfig, embedding: bool = True) -> float:
    """The init std of the word and position embeddings (and of a tied output layer's copy): Megatron's
    --embedding-init-method-std, by default --init-method-std; ``embedding`` False (an untied output
    layer): --init-method-std, or under muP the embeddings' (unscaled, as Megatron)."""
    given = cfg.embedding_init_method_std
    if not embedding and not cfg.use_mup:
        return cfg.init_method_std
    return cfg.init_method_std if given is None else given


def rotary_of(cfg: ModelConfig, device) -> Optional[Rotary]:
    """The rotary tables of the model: MLA rotates its own rotary part whatever the position embedding."""
    if cfg.multi_latent_attention:
        return MLARotary(cfg, device)
    return Rotary(cfg, device) if cfg.position_embedding_type in ("rope", "yarn") else None


def resolved_config(config: ModelConfig, max_sequence_length: Optional[int] = None) -> ModelConfig:
    """The model config GPTModel builds from: resolved by the caller (the model never resolves one), and
    for ``max_sequence_length`` positions when one is given (Megatron's argument)."""
    if not config.is_resolved:
        raise ConfigError("GPTModel takes a resolved ModelConfig: pass config.resolved() (or the model section "
                          "of a config from parse_args / resolve)")
    if max_sequence_length is not None and max_sequence_length != config.max_position_embeddings:
        raise ConfigError(f"GPTModel(max_sequence_length={max_sequence_length}) with a config resolved for "
                          f"--max-position-embeddings {config.max_position_embeddings}: pass config.resolved("
                          f"max_position_embeddings={max_sequence_length}) instead")
    return config


class OutputHead:
    """The language-model output of a model (GPT's, T5's): ``output_layer`` over the last hidden states, tied to
    ``embedding.word_embeddings`` when it has no weight of its own, and the token losses through the fused
    output layer + cross-entropy (``fused_output_loss``) or plain logits. The model sets ``output_layer``,
    ``embedding``, ``output_mult``, ``kernels``, ``par`` and ``fused_output_loss``."""

    def output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the output layer multiplies: muP's logit multiplier applied to its input (no bias, so
        the logits are scaled the same)."""
        return x if self.output_mult == 1.0 else x * self.output_mult

    def _token_losses(self, x: torch.Tensor, labels: torch.Tensor, detach_weight: bool = False) -> torch.Tensor:
        """Cross-entropy [b, s] (fp32) of the output layer on ``x`` [s(/TP), b, h] against ``labels`` [b, s];
        ``detach_weight``: no gradient reaches the output layer (--mtp-detach-heads)."""
        target, x, w = labels.transpose(0, 1), self.head_input(x), self.output_weight()
        w = w.detach() if detach_weight else w
        if self.fused_output_loss:  # the logits of the whole batch never exist
            k = self.kernels
            loss = linear_cross_entropy(self.output_layer.enter(x), w, target, self.par.tp_group,
                                        kernel=k.kernel_cross_entropy,
                                        fast_exp=k.kernel_ce_fast_exp == "on", cublaslt=k.kernel_cublaslt != "off")
        else:  # the layer's own weight through its own call, which honours a gradient fused into main_grad
            own = self.output_layer.weight is not None and not detach_weight
            logits = self.output_layer(x) if own else self.output_layer(x, w)
            loss = vocab_parallel_cross_entropy(logits, target, self.par.tp_group)
        return loss.transpose(0, 1).contiguous()  # [b, s]


def parallel_of(cfg: ModelConfig, dims: ParallelDims, sequence_parallel: bool, seed: int, kernels: KernelConfig,
                device) -> Parallel:
    """What the layers of a model on ``dims`` need when built: TP group, sequence parallelism, the dropout stream
    of the TP regions (one per TP rank and pipeline stage, as Megatron's) and the kernel switches."""
    rng = RNGTracker(seed + 100 * dims.pp_rank, dims.tp_rank, device or "cpu") if dims.tp > 1 else None
    par = Parallel(tp_group=dims.tp_group, tp_size=dims.tp, sequence_parallel=sequence_parallel and dims.tp > 1,
                   rng=rng, dims=dims, kernels=kernels)
    if cfg.moe_router_force_load_balancing:  # random router logits: Megatron's expert-parallel stream
        par.expert_rng = RNGTracker(seed + 100 * dims.pp_rank, 100 * dims.ep_rank + dims.etp_rank,
                                    device or "cpu", offset=EXPERT_SEED_OFFSET)
    return par


def output_layer_of(cfg: ModelConfig, vocab_size: int, par: Parallel, seed: int, tied: bool, pre_process: bool,
                    bias: bool = False, fusable: bool = True, device=None, dtype=None) -> ColumnParallelLinear:
    """The vocabulary-parallel output layer of the last stage. Tied: drawn from the embedding's stream, so the
    last stage's copy equals the word embedding; on a one-stage model it has no weight of its own (the word
    embedding is passed in), on a pipeline's last stage a copy kept equal through the embedding group.
    ``fusable``: every use of its weight honours ``main_grad`` (GPT's fused output loss does; a plain
    ``layer(x, weight)`` call does not)."""
    with seeded_init(seed, "embedding" if tied else "output_layer", device):
        init = init_normal(embedding_std(cfg, tied))
        layer = ColumnParallelLinear(cfg.hidden_size, vocab_size, tp_group=par.tp_group, bias=bias,
                                     sequence_parallel=par.sequence_parallel, init_method=init, device=device,
                                     dtype=dtype)
    for p in (layer.weight, layer.bias):
        if p is not None:
            update_spec(p, vocab_rows=True)
    if fusable:
        mark_fusable(layer)  # its gradient may go into main_grad directly (cross_entropy.py)
    if tied:
        if pre_process:
            layer.weight = None
        else:
            update_spec(layer.weight, tied="embedding", copy_of=WORD_EMBEDDING)
    return layer


def tie_first_stage(model: nn.Module, pre_process: bool, post_process: bool) -> None:
    """A tied word embedding on the first stage of a pipeline: its gradients are summed with the last stage's
    copy (through the embedding group)."""
    if model.share_embeddings and pre_process and not post_process:
        update_spec(model.embedding.word_embeddings.weight, tied="embedding")


class GPTModel(OutputHead, nn.Module):
    """Decoder LM. ``pre_process``/``post_process`` say whether this pipeline stage holds the
    embedding / the final norm, output layer and loss; ``layer_offset``/``num_layers`` which blocks.

    forward(input_ids [b, s], position_ids, attention_mask, labels [b, s]) returns the per-token loss
    [b, s] (fp32) when labels are given on the last stage, else logits [b, s, vocab/TP] on the last
    stage, else the hidden states [s(/TP), b, h] to send to the next stage. ``attention_mask`` is
    Megatron's ([b, 1, s, s] bool, True = masked out, the causal pattern included); without it attention
    is causal. ``document_ids`` [b, s] (packed documents, ``--reset-attention-mask``) make it causal
    within each document. The rotary tables and the mask go down to attention in one ForwardContext.
    ``kernels``: the kernel switches (``paratron.config.KernelConfig``, the run's ``cfg.kernels``; None: the
    defaults, each path taken where the device and packages allow). ``fp8``: a ``paratron.fp8.Recipe`` runs the
    blocks' QKV, proj, fc1 and fc2 matmuls in FP8.
    With context parallelism (``dims.cp`` > 1) every input is this rank's part of the sequence
    (``paratron/parallel/context.py``), except ``document_ids``, which cover the whole sequence, and
    ``cp_comm_type`` says how attention crosses the CP ranks (p2p ring, a2a or allgather).
    """

    def __init__(self, config: ModelConfig, vocab_size: int, max_sequence_length: Optional[int] = None,
                 dims: Optional[ParallelDims] = None, *, sequence_parallel: bool = False, seed: int = 1234,
                 pre_process: bool = True, post_process: bool = True, layer_offset: int = 0,
                 num_layers: Optional[int] = None, recompute_granularity: Optional[str] = None,
                 recompute_method: Optional[str] = None, recompute_num_layers: Optional[int] = None,
                 fp8: Optional[fp8_mod.Recipe] = None, cp_comm_type: str = "p2p",
                 kernels: Optional[KernelConfig] = None, device=None, dtype=None):
        super().__init__()
        cfg = resolved_config(config, max_sequence_length)
        self.config, self.vocab_size = cfg, vocab_size
        self.dims = dims = dims or ParallelDims()
        self.kernels = kernels if kernels is not None else KernelConfig()  # the switches (config/kernels.py)
        self.par = parallel_of(cfg, dims, sequence_parallel, seed, self.kernels, device)
        self.pre_process, self.post_process = pre_process, post_process
        self.cp = ContextParallel.from_dims(dims, cp_comm_type)  # None at CP 1
        self.share_embeddings, self.output_mult = not cfg.untie_embeddings_and_output_weights, mup.output_mult(cfg)
        # Initial weights: one stream per named piece (see seeded_init), so any pipeline split of the
        # model starts from the weights of the one-stage model built with the same seed.
        self.embedding = None
        if pre_process:
            with seeded_init(seed, "embedding", device):
                self.embedding = Embedding(cfg, vocab_size, self.par, device, dtype)
        self.rotary = rotary_of(cfg, device)
        n = cfg.num_layers if num_layers is None else num_layers
        self.decoder = TransformerStack(cfg, self.par, n, layer_offset, final_norm=post_process,
                                        recompute_granularity=recompute_granularity, recompute_method=recompute_method,
                                        recompute_num_layers=recompute_num_layers, device=device, dtype=dtype,
                                        seed=seed)
        fp8_mod.attach(self.decoder, fp8, cfg.num_layers)  # FP8 matmuls in QKV / proj / fc1 / fc2 with a recipe
        self.output_layer = (output_layer_of(cfg, vocab_size, self.par, seed, self.share_embeddings, pre_process,
                                             device=device, dtype=dtype) if post_process else None)
        self.mtp = build_mtp(cfg, self.par, pre_process and post_process, seed, recompute_granularity, fp8,
                             device, dtype)  # multi-token prediction (model/mtp.py), None without
        tie_first_stage(self, pre_process, post_process)
        set_cublaslt(self, self.kernels.kernel_cublaslt != "off")
        self.input_tensor: Optional[torch.Tensor] = None
        self.fused_output_loss = True  # chunked output layer + cross-entropy (False: plain logits path)

    # Megatron's pipeline convention: non-first stages take their input through this.
    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None):
        """``loss_mask`` [b, s]: read by multi-token prediction only (its losses are averaged over it)."""
        if self.pre_process:
            b, s = input_ids.shape
            pos = position_ids if position_ids is not None else torch.arange(s, device=input_ids.device).expand(b, s)
            x = self.embedding(input_ids, pos)
        else:
            x = self.input_tensor
            s = x.size(0) * (self.par.tp_size if self.par.sequence_parallel else 1)
        rope = self.rotary(s, position_ids) if self.rotary is not None else None
        ctx = self._context(rope, attention_mask, document_ids)
        x = self.decoder(x, ctx)
        if not self.post_process:
            return x
        if labels is None:
            logits = self.output_layer(self.head_input(x), self.output_weight())  # [s, b, vocab/TP]
            return logits.transpose(0, 1).contiguous()  # [b, s, vocab/TP]
        loss = self._token_losses(x, labels)
        if self.mtp is not None and self.training:  # the MTP losses join the backward (not the reported loss)
            hiddens = self.mtp(x, input_ids, pos, ctx, self.embedding)
            loss = self.mtp.attach_loss(loss, hiddens, labels, loss_mask, self._token_losses, ctx.cp)
        return loss

    def _context(self, rope, attention_mask, document_ids) -> ForwardContext:
        """What attention needs: ``attention_mask`` is Megatron's (True = masked out, causality
        included); ``document_ids`` [b, s] of the whole sequence make attention causal within
        documents (a mask built here once per forward at CP 1, per block pair under CP)."""
        if self.cp is not None:
            if attention_mask is not None:
                raise ValueError("a dense attention mask cannot be split over context-parallel ranks; pass "
                                 "document_ids (the data path does with --reset-attention-mask)")
            return ForwardContext(rope=rope, document_ids=document_ids, cp=self.cp)
        if document_ids is not None:
            mask = document_causal_mask(document_ids)
            if attention_mask is not None:
                mask = mask & ~attention_mask
            return ForwardContext(rope=rope, mask=mask, causal=False, document_ids=document_ids)
        if attention_mask is None:
            return ForwardContext(rope=rope)
        return ForwardContext(rope=rope, mask=~attention_mask, causal=False)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.embedding is not None:
            n -= self.embedding.word_embeddings.weight.numel()
        return n

