"""T5 in the trainer (``--model t5``, ``pretrain_t5.py``): the model of a rank, the forward step over span-corruption
batches (Megatron's ``text_enc`` / ``text_dec`` / ``labels`` / ``loss_mask`` / ``enc_mask`` / ``dec_mask``), the
datasets and the FLOPs of an iteration."""
from __future__ import annotations

from functools import partial

import torch

from ..config import Config, ModelConfig
from ..data.t5_dataset import T5DataConfig, t5_builder
from ..model import recompute
from ..model.t5 import T5Model, stack_depths
from ..parallel.dims import ParallelDims
from ..parallel.layout import ID_KEYS, BatchLayout, check_batch_ids


def build_t5_model(cfg: Config, dims: ParallelDims, device: torch.device, dtype: torch.dtype) -> T5Model:
    tr = cfg.train
    model = T5Model(cfg.model, cfg.padded_vocab_size, dims, sequence_parallel=cfg.parallel.sequence_parallel,
                    seed=tr.seed, recompute_granularity=tr.recompute_granularity,
                    recompute_method=tr.recompute_method, recompute_num_layers=tr.recompute_num_layers,
                    kernels=cfg.kernels, device=device, dtype=dtype)
    model.fused_output_loss = not tr.no_fused_output_loss
    if tr.recompute_granularity == "selective":  # --recompute-modules (resolved: default core_attn)
        recompute.apply(model.encoder, tr.recompute_modules)
        recompute.apply(model.decoder, tr.recompute_modules)
        for layer in model.decoder.layers:
            layer.cross_attention.recompute_core = "core_attn" in tr.recompute_modules
    model.embedding.word_embeddings.check_ids = not cfg.data.no_token_id_check
    if tr.torch_compile:  # regional: each layer compiled in place
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            layer.compile()
    return model


def make_t5_forward_step(layout: BatchLayout, loss_func):
    """Megatron's forward_step_func for T5: a span-corruption micro-batch through the model; the loss over the
    decoder's real tokens (labels past them are -1 in Megatron's samples: read as 0, masked out)."""
    def forward_step(data_iterator, model):
        b = next(data_iterator)
        check_batch_ids(b, layout.vocab_size, ID_KEYS["t5"])  # on the loader's host tensors: no device sync
        dev = {"device": layout.device, "non_blocking": True}
        loss_mask = b["loss_mask"].to(**dev)
        labels = b["labels"].to(**dev).clamp(min=0)
        output = model(b["text_enc"].to(**dev), b["text_dec"].to(**dev), b["enc_mask"].to(**dev).bool(),
                       b["dec_mask"].to(**dev).bool(), labels=labels)
        return output, partial(loss_func, loss_mask)
    return forward_step


def t5_data_builder(cfg: Config, tokenizer):
    """The ``make_builder`` of the run's T5 datasets."""
    return t5_builder(T5DataConfig.from_config(cfg.data, cfg.model, cfg.train.seed), tokenizer)


def t5_flops_per_iteration(m: ModelConfig, padded_vocab: int, batch: int) -> float:
    """FLOPs of forward + backward of one iteration (the terms of Megatron's GPT formula, megatron_facts §5, per
    stack): the encoder's attention is bidirectional (whole, not half), each decoder layer adds cross-attention
    (queries and output on the decoder's tokens, keys and values on the encoder's, every pair), and the output
    layer runs on the decoder's tokens."""
    h, f, q = m.hidden_size, m.ffn_hidden_size, m.kv_channels * m.num_attention_heads
    se, sd = m.encoder_seq_length or m.seq_length, m.decoder_seq_length or m.seq_length
    enc_layers, dec_layers = stack_depths(m)
    gated = 3 if (m.swiglu or m.geglu or m.quick_geglu) else 2
    layer = 6 * (h * 3 * q + q * h) + 6 * h * f * gated  # QKV + output projection + MLP, per token
    encoder = enc_layers * (se * layer + se * se * 12 * q)
    cross = dec_layers * (sd * 6 * 2 * h * q + se * 6 * 2 * h * q + sd * se * 12 * q)
    decoder = dec_layers * (sd * layer + sd * sd * 6 * q) + cross + sd * 6 * h * padded_vocab
    return float(batch * (encoder + decoder))
