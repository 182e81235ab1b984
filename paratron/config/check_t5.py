"""Checks of T5's flags (``--model t5``, ``pretrain_t5.py``): the encoder-decoder's depths and lengths, what it
refuses by name (pipeline and context parallelism, ...), and the T5 flags given to another model (an encoder
without a decoder)."""
from __future__ import annotations

from .rules import changed_flags, need
from .values import MODELS

T5_ONLY = ("encoder_num_layers", "decoder_num_layers", "encoder_seq_length", "decoder_seq_length")


def resolve_encoder_decoder(m) -> None:
    """Megatron's aliases, before the model's other defaults: --encoder-num-layers is --num-layers, and
    --encoder-seq-length is --seq-length."""
    if m.encoder_num_layers is not None:
        m.num_layers = m.encoder_num_layers
    if m.encoder_seq_length is not None:
        m.seq_length = m.encoder_seq_length


def validate_t5(cfg) -> None:
    m, p, d = cfg.model, cfg.parallel, cfg.data
    need(m.model in MODELS, f"--model {m.model}: choose one of {', '.join(MODELS)}")
    if m.model != "t5":
        given = changed_flags(m, names=T5_ONLY)
        need(not given, f"{', '.join(given)}: an encoder-decoder's flags, but --model {m.model} has no decoder "
             "(an encoder without a decoder); add --model t5 (or run pretrain_t5.py), or remove them")
        need(m.position_embedding_type != "relative", "--position-embedding-type relative: T5's relative buckets; "
             "add --model t5 (or run pretrain_t5.py)")
        return
    m.encoder_num_layers = m.num_layers
    m.encoder_seq_length = m.seq_length
    if m.decoder_num_layers is None:
        m.decoder_num_layers = m.num_layers
    if m.decoder_seq_length is None:
        m.decoder_seq_length = m.seq_length
    need(m.position_embedding_type != "learned_absolute" or m.decoder_seq_length <= m.max_position_embeddings,
         f"--decoder-seq-length {m.decoder_seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}")
    need(d.vocab_extra_ids >= 1, "--model t5: span corruption replaces each masked span by a sentinel token: give "
         "--vocab-extra-ids N (Megatron's T5 example: 100)")
    tp = p.tensor_model_parallel_size
    need(not p.sequence_parallel or m.decoder_seq_length % tp == 0, f"--sequence-parallel: --decoder-seq-length "
         f"{m.decoder_seq_length} must be divisible by --tensor-model-parallel-size {tp}")
    refused = (
        (p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1 (Megatron refuses pipeline "
         "parallelism for T5 too; paratron has no encoder/decoder pipeline split)"),
        (p.context_parallel_size > 1, "--context-parallel-size > 1 (bidirectional and cross-attention are not "
         "split over context-parallel ranks)"),
        (m.position_embedding_type not in ("learned_absolute", "relative"),
         f"--position-embedding-type {m.position_embedding_type} (T5 takes learned_absolute or relative)"),
        (m.num_query_groups not in (None, m.num_attention_heads) or m.group_query_attention,
         "--group-query-attention"),
        (m.num_experts is not None, "--num-experts"), (m.multi_latent_attention, "--multi-latent-attention"),
        (m.mtp_num_layers is not None, "--mtp-num-layers"), (m.attention_output_gate, "--attention-output-gate"),
        (m.window_size is not None or m.softmax_type != "vanilla", "--window-size / --softmax-type"),
        (cfg.train.fp8_format is not None, "--fp8-format (the FP8 linears are wired into GPT's layers only)"),
        (d.mock_data, "--mock-data (T5 samples come from an indexed dataset: Megatron has no T5 mock data)"),
        (d.sft or d.fim_data, "--sft / --fim-data (GPT data formats)"),
        (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss,
         "--reset-position-ids / --reset-attention-mask / --eod-mask-loss (GPT document packing)"),
        (cfg.log.sample_prompt is not None, "--sample-prompt (a GPT continuation; use paratron generate)"),
    )
    for bad, what in refused:
        need(not bad, f"--model t5: {what} is not supported; remove it")
