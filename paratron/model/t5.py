"""The encoder-decoder language model: T5 (Megatron-core's T5Model; T5 v1.1 by configuration).

The encoder (``encoder.layers.*``, ``--encoder-num-layers``) is the GPT block stack attending both ways over the
real tokens of its input; the decoder (``decoder.layers.*``, ``--decoder-num-layers``) adds cross-attention over
the encoder's output to each layer (model/cross_attention.py) and attends causally. One word embedding serves
both inputs and, unless ``--untie-embeddings-and-output-weights``, the output layer. Positions are learned
absolute (Megatron's T5 default) or T5's relative buckets (``--position-embedding-type relative``): one bias table
per stack (Megatron's ``encoder_relative_pos_emb`` / ``decoder_relative_pos_emb``), computed once per forward and
added to every layer's attention scores; cross-attention has none (Hugging Face's T5 keeps the table in its first
layer and passes the bias to the others: the same numbers).

Pipeline and context parallelism are refused for T5 by the config checks (Megatron refuses pipeline parallelism
for T5 too).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..config.kernels import KernelConfig
from ..parallel.dims import ParallelDims
from ..parallel.random import seeded_init
from ..parallel.tensor import init_normal, set_cublaslt
from .context import ForwardContext
from .cross_attention import DecoderStack
from .gpt import Embedding, OutputHead, output_layer_of, parallel_of, resolved_config
from .relative import RelativePositionBias
from .transformer import TransformerStack


def stack_depths(cfg: ModelConfig) -> tuple[int, int]:
    """(encoder layers, decoder layers): --encoder-num-layers (else --num-layers), --decoder-num-layers (else the
    encoder's)."""
    enc = cfg.encoder_num_layers or cfg.num_layers
    return enc, cfg.decoder_num_layers or enc


def attention_mask(allowed: Optional[torch.Tensor], bias: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """The mask of a pass: ``allowed`` (bool, True = may attend, broadcasting to [b, heads, q, k]) alone, or with
    the relative ``bias`` [1, heads, q, k] an additive float mask (masked scores at the dtype's lowest value, so a
    row with nothing allowed stays finite, as Hugging Face's)."""
    if bias is None:
        return allowed
    bias = bias.to(dtype)
    if allowed is None:
        return bias
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


class T5Model(OutputHead, nn.Module):
    """forward(encoder_input_ids [b, se], decoder_input_ids [b, sd], encoder_padding_mask, decoder_padding_mask
    ([b, s] bool, True = a real token; None: all are), labels [b, sd]) returns the per-token loss [b, sd] (fp32)
    with labels, else the logits [b, sd, vocab/TP]. ``encode`` and ``decode`` are the halves (generation runs the
    encoder once, then the decoder step by step over a KV cache)."""

    def __init__(self, config: ModelConfig, vocab_size: int, dims: Optional[ParallelDims] = None, *,
                 sequence_parallel: bool = False, seed: int = 1234, recompute_granularity: Optional[str] = None,
                 recompute_method: Optional[str] = None, recompute_num_layers: Optional[int] = None,
                 kernels: Optional[KernelConfig] = None, device=None, dtype=None):
        super().__init__()
        cfg = resolved_config(config)
        self.config, self.vocab_size = cfg, vocab_size
        self.dims = dims = dims or ParallelDims()
        self.kernels = kernels if kernels is not None else KernelConfig()
        self.par = parallel_of(cfg, dims, sequence_parallel, seed, self.kernels, device)
        self.pre_process = self.post_process = True
        self.share_embeddings, self.output_mult = not cfg.untie_embeddings_and_output_weights, 1.0
        self.encoder_layers, self.decoder_layers = stack_depths(cfg)
        with seeded_init(seed, "embedding", device):
            self.embedding = Embedding(cfg, vocab_size, self.par, device, dtype)
        self.encoder_relative_pos_emb = self.decoder_relative_pos_emb = None
        if cfg.position_embedding_type == "relative":
            with seeded_init(seed, "relative", device):
                self.encoder_relative_pos_emb = self._relative(cfg, True, device, dtype)
                self.decoder_relative_pos_emb = self._relative(cfg, False, device, dtype)
        recompute = dict(recompute_granularity=recompute_granularity, device=device, dtype=dtype, seed=seed)
        self.encoder = TransformerStack(cfg, self.par, self.encoder_layers, recompute_method=recompute_method,
                                        recompute_num_layers=recompute_num_layers, **recompute)
        self.decoder = DecoderStack(cfg, self.par, self.decoder_layers, **recompute)
        self.output_layer = output_layer_of(cfg, vocab_size, self.par, seed, self.share_embeddings, True,
                                            device=device, dtype=dtype)
        set_cublaslt(self, self.kernels.kernel_cublaslt != "off")
        self.fused_output_loss = True
        self.input_tensor = None

    def _relative(self, cfg: ModelConfig, bidirectional: bool, device, dtype) -> RelativePositionBias:
        return RelativePositionBias(cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
                                    cfg.num_attention_heads, bidirectional, self.par.tp_group,
                                    init_normal(cfg.init_method_std), device, dtype)

    def set_input_tensor(self, tensor) -> None:  # (the schedules' convention; T5 runs without pipelining)
        self.input_tensor = tensor

    def _embed(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        b, s = ids.shape
        return self.embedding(ids, torch.arange(offset, offset + s, device=ids.device).expand(b, s))

    def encoder_context(self, ids: torch.Tensor, padding: Optional[torch.Tensor], dtype) -> ForwardContext:
        """The encoder's pass: every token attends to every real token, with the relative bias."""
        s = ids.size(1)
        bias = self.encoder_relative_pos_emb(s, s) if self.encoder_relative_pos_emb is not None else None
        keys = padding[:, None, None, :] if padding is not None else None
        mask = attention_mask(keys, bias, dtype)
        return ForwardContext(mask=mask, causal=False) if mask is not None else ForwardContext(causal=False)

    def decoder_context(self, q: int, k: int, padding: Optional[torch.Tensor], dtype, offset: int = 0,
                        kv_cache=None) -> ForwardContext:
        """The decoder's self-attention pass: ``q`` queries at positions offset.. over ``k`` keys, causal."""
        device = self.embedding.word_embeddings.weight.device
        allowed = torch.arange(k, device=device)[None, :] <= torch.arange(offset, offset + q, device=device)[:, None]
        if padding is not None:
            allowed = allowed & padding[:, None, None, :k]
        bias = self.decoder_relative_pos_emb(q, k, offset) if self.decoder_relative_pos_emb is not None else None
        return ForwardContext(mask=attention_mask(allowed, bias, dtype), causal=False, kv_cache=kv_cache)

    @staticmethod
    def cross_context(encoder_padding: Optional[torch.Tensor]) -> ForwardContext:
        """Cross-attention's pass: every decoder token attends to every real encoder token."""
        return ForwardContext.bidirectional(encoder_padding)

    def encode(self, ids: torch.Tensor, padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The encoder's output [se(/TP), b, h] (after its final norm)."""
        x = self._embed(ids)
        return self.encoder(x, self.encoder_context(ids, padding, x.dtype))

    def decode(self, ids: torch.Tensor, memory: torch.Tensor, cross: ForwardContext,
               ctx: Optional[ForwardContext] = None, offset: int = 0) -> torch.Tensor:
        """The decoder's last hidden states [sd(/TP), b, h] for ``ids`` at positions offset.. (``ctx``: the
        self-attention pass, by default causal over ``ids`` alone)."""
        x = self._embed(ids, offset)
        if ctx is None:
            ctx = self.decoder_context(ids.size(1), ids.size(1), None, x.dtype)
        return self.decoder(x, ctx, memory, cross)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s(/TP), b, h] -> [b, s, vocab/TP]."""
        return self.output_layer(self.head_input(x), self.output_weight()).transpose(0, 1).contiguous()

    def forward(self, encoder_input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                encoder_padding_mask: Optional[torch.Tensor] = None,
                decoder_padding_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        memory = self.encode(encoder_input_ids, encoder_padding_mask)
        s = decoder_input_ids.size(1)
        ctx = self.decoder_context(s, s, decoder_padding_mask, memory.dtype)
        x = self.decode(decoder_input_ids, memory, self.cross_context(encoder_padding_mask), ctx)
        if labels is None:
            return self.logits(x)
        return self._token_losses(x, labels)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embedding.word_embeddings.weight.numel() if exclude_embeddings else n
