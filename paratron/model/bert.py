"""BERT: Megatron-core's ``BertModel`` over GPT's parts (``--model bert``, ``pretrain_bert.py``).

    embedding (word + learned position + tokentype when the binary head is on) -> dropout
    -> encoder: GPT's pre-norm transformer layers run bidirectionally under the key padding mask
       (``encoder.layers.N``, then ``encoder.final_layernorm``)
    -> LM head: ``lm_head.dense`` (h -> h) -> GELU -> ``lm_head.layer_norm``
       -> ``output_layer`` (vocabulary-parallel, tied to the word embedding unless
       --untie-embeddings-and-output-weights, with its own bias) -> per-token cross-entropy
    -> binary head (unless --bert-no-binary-head): ``pooler.dense`` + tanh on the first token ([CLS]),
       then ``binary_head`` (h -> 2): sentence order / next sentence.

Parameter names are Megatron-core's. The LM head's LayerNorm is LayerNorm whatever --normalization says (as
Megatron's), zero-centred with --apply-layernorm-1p; the dense layers are replicated over TP (their gradients
summed over TP under sequence parallelism, where each rank sees its share of the tokens).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8 as fp8_mod
from ..config import ConfigError, ModelConfig
from ..config.kernels import KernelConfig
from ..parallel import comm
from ..parallel.dims import ParallelDims
from ..parallel.random import seeded_init
from ..parallel.cross_entropy import logits_cross_entropy, vocab_parallel_cross_entropy
from ..parallel.tensor import ReplicatedLinear, init_normal
from .context import ForwardContext
from .gpt import Embedding, GPTModel, output_layer_of, parallel_of, resolved_config, tie_first_stage
from .norms import Norm
from .transformer import TransformerStack


class BertLMHead(nn.Module):
    """dense -> GELU (erf) -> LayerNorm, on this rank's tokens."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, init_normal(cfg.init_method_std),
                                      sequence_parallel, device, dtype, bias=True)
        self.layer_norm = Norm("LayerNorm", cfg.hidden_size, cfg.norm_epsilon, sequence_parallel, device, dtype,
                               zero_centered=cfg.apply_layernorm_1p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(x)))


class Pooler(nn.Module):
    """tanh(dense(h of the first token)); under sequence parallelism the sequence is gathered first."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, init_normal(cfg.init_method_std), False,
                                      device, dtype, bias=True)

    def forward(self, x: torch.Tensor, par) -> torch.Tensor:
        if par.sequence_parallel:  # every TP rank computes the same pooled vector: its gradient is split back
            x = comm.unscatter_from_sp(x, par.tp_group)
        return torch.tanh(self.dense(x[0]))


class BertModel(GPTModel):
    """Megatron-core's BertModel. ``pre_process`` / ``post_process`` / ``layer_offset`` / ``num_layers``: the
    pipeline chunk, as GPTModel's. ``add_binary_head`` (default: not --bert-no-binary-head) also adds the
    tokentype embeddings (2 types), as pretrain_bert.py does.

    forward(input_ids [b, s], padding_mask [b, s] (True / >= 0.5 = real token), tokentype_ids [b, s],
    lm_labels [b, s]) returns on the last stage (per-token loss [b, s] fp32, binary logits [b, 2] or None) with
    labels, else (logits [b, s, vocab/TP], binary logits or None); on other stages the hidden states."""

    def __init__(self, config: ModelConfig, vocab_size: int, max_sequence_length: Optional[int] = None,
                 dims: Optional[ParallelDims] = None, *, add_binary_head: Optional[bool] = None,
                 sequence_parallel: bool = False, seed: int = 1234, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_layers: Optional[int] = None,
                 recompute_granularity: Optional[str] = None, recompute_method: Optional[str] = None,
                 recompute_num_layers: Optional[int] = None, fp8=None, kernels: Optional[KernelConfig] = None,
                 device=None, dtype=None):
        nn.Module.__init__(self)
        cfg = resolved_config(config, max_sequence_length)
        if cfg.position_embedding_type != "learned_absolute":
            raise ConfigError(f"BERT takes --position-embedding-type learned_absolute (Megatron's BertModel also "
                              f"offers rope; paratron does not yet), not {cfg.position_embedding_type}")
        self.config, self.vocab_size = cfg, vocab_size
        self.dims = dims = dims or ParallelDims()
        self.kernels = kernels if kernels is not None else KernelConfig()
        self.par = parallel_of(cfg, dims, sequence_parallel, seed, self.kernels, device)
        self.pre_process, self.post_process, self.cp, self.mtp = pre_process, post_process, None, None
        self.add_binary_head = (not cfg.bert_no_binary_head) if add_binary_head is None else add_binary_head
        self.share_embeddings, self.output_mult = not cfg.untie_embeddings_and_output_weights, 1.0
        self.embedding = None
        if pre_process:
            with seeded_init(seed, "embedding", device):
                self.embedding = Embedding(cfg, vocab_size, self.par, device, dtype,
                                           num_tokentypes=2 if self.add_binary_head else 0)
        self.rotary = None
        n = cfg.num_layers if num_layers is None else num_layers
        self.encoder = TransformerStack(cfg, self.par, n, layer_offset, final_norm=post_process,
                                        recompute_granularity=recompute_granularity, recompute_method=recompute_method,
                                        recompute_num_layers=recompute_num_layers, device=device, dtype=dtype,
                                        seed=seed)
        fp8_mod.attach(self.encoder, fp8, cfg.num_layers, prefix="encoder")
        self.output_layer = self.lm_head = self.pooler = self.binary_head = None
        if post_process:
            with seeded_init(seed, "lm_head", device):
                self.lm_head = BertLMHead(cfg, self.par.sequence_parallel, device, dtype)
            self.output_layer = output_layer_of(cfg, vocab_size, self.par, seed, self.share_embeddings, pre_process,
                                                bias=True, fusable=False, device=device, dtype=dtype)
            if self.add_binary_head:
                with seeded_init(seed, "binary_head", device):
                    self.binary_head = ReplicatedLinear(cfg.hidden_size, 2, init_normal(cfg.init_method_std), False,
                                                        device, dtype, bias=True)
                    self.pooler = Pooler(cfg, device, dtype)
        tie_first_stage(self, pre_process, post_process)
        self.input_tensor: Optional[torch.Tensor] = None
        # the output layer has a bias (no fused layer + loss): logits, then the loss over them in one pass where it
        # applies (parallel/cross_entropy.py: logits_cross_entropy); False (--no-fused-output-loss): the plain loss
        self.fused_output_loss = True

    @property
    def decoder(self) -> TransformerStack:
        """The stack under GPTModel's name (pipeline chunks, recomputation and compilation read it)."""
        return self.encoder

    def forward(self, input_ids: Optional[torch.Tensor], padding_mask: Optional[torch.Tensor] = None,
                tokentype_ids: Optional[torch.Tensor] = None, lm_labels: Optional[torch.Tensor] = None):
        if self.pre_process:
            b, s = input_ids.shape
            pos = torch.arange(s, device=input_ids.device).expand(b, s)
            x = self.embedding(input_ids, pos, tokentype_ids if self.add_binary_head else None)
        else:
            x = self.input_tensor
        real = None if padding_mask is None else (padding_mask if padding_mask.dtype == torch.bool
                                                  else padding_mask >= 0.5)
        x = self.encoder(x, ForwardContext.bidirectional(real))
        if not self.post_process:
            return x
        binary = self.binary_head(self.pooler(x, self.par)) if self.binary_head is not None else None
        logits = self.output_layer(self.lm_head(x), self.output_weight())  # [s, b, vocab/TP]
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary
        target = lm_labels.clamp(min=0).transpose(0, 1)  # Megatron's -1 (no prediction) is masked by the loss
        k = self.kernels
        if self.fused_output_loss:  # (logits_cross_entropy decides where its kernel applies; it then overwrites them)
            loss = logits_cross_entropy(logits, target, self.par.tp_group,
                                        kernel=k.kernel_cross_entropy,
                                        fast_exp=k.kernel_ce_fast_exp == "on")
        else:
            loss = vocab_parallel_cross_entropy(logits, target, self.par.tp_group)
        return loss.transpose(0, 1).contiguous(), binary
