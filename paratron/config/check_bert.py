"""Checks of ``--model`` and BERT's flags (``--model bert``, ``pretrain_bert.py``): what paratron's BertModel
and BertDataset build, and what they refuse by name."""
from __future__ import annotations

from .rules import changed_flags, need
from .values import MODELS


def default_tokenizer(model) -> str:
    """The --tokenizer-type a --vocab-file means without one: Megatron's default of the model's entry point."""
    return "BertWordPieceLowerCase" if model.model in ("bert", "t5") else "GPT2BPETokenizer"


def validate_model_family(cfg) -> None:
    m, d = cfg.model, cfg.data
    need(m.model in MODELS, f"--model {m.model}: choose one of {', '.join(MODELS)}")
    if m.model in ("bert", "t5"):
        need(0.0 < d.mask_prob < 1.0, f"--mask-prob {d.mask_prob}: a probability strictly between 0 and 1")
        need(0.0 <= d.short_seq_prob <= 1.0, f"--short-seq-prob {d.short_seq_prob}: a probability in [0, 1]")
    if m.model != "bert":
        changed = changed_flags(m, names=("bert_no_binary_head", "bert_embedder_type")) + (changed_flags(
            d, names=("mask_prob", "short_seq_prob")) if m.model == "gpt" else [])
        need(not changed, f"{', '.join(changed)}: read only by BERT (--mask-prob, --short-seq-prob: and T5); add "
             "--model bert (or run pretrain_bert.py)")
        return
    need(m.bert_embedder_type == "megatron", f"--bert-embedder-type {m.bert_embedder_type}: paratron builds "
         "Megatron's embedder only (huggingface is Megatron's retrieval embedder); remove the flag")
    refused = (
        (cfg.parallel.context_parallel_size > 1, "--context-parallel-size > 1 (BERT's bidirectional attention "
         "under context parallelism is not implemented)"),
        (m.position_embedding_type != "learned_absolute", f"--position-embedding-type {m.position_embedding_type} "
         "(BERT takes learned_absolute)"),
        (m.num_experts is not None, "--num-experts (a BERT of MoE layers is not tested)"),
        (m.multi_latent_attention, "--multi-latent-attention"),
        (m.mtp_num_layers is not None, "--mtp-num-layers (multi-token prediction is causal)"),
        (m.window_size is not None or m.softmax_type != "vanilla", "--window-size / --softmax-type"),
        (cfg.parallel.virtual_pipeline_model_parallel_size not in (None, 1)
         or cfg.parallel.num_virtual_stages_per_pipeline_rank not in (None, 1)
         or cfg.parallel.pipeline_model_parallel_layout is not None,
         "virtual pipeline stages / --pipeline-model-parallel-layout (BERT runs plain 1F1B)"),
        (cfg.train.calculate_per_token_loss, "--calculate-per-token-loss (the BERT loss is Megatron's per-batch "
         "mean)"),
        (d.mock_data, "--mock-data (BERT samples are sentences: preprocess with --split-sentences)"),
        (d.sft or d.fim_data, "--sft / --fim-data (GPT data formats)"),
        (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss,
         "--reset-position-ids / --reset-attention-mask / --eod-mask-loss (GPT document packing)"),
    )
    for bad, what in refused:
        need(not bad, f"--model bert: {what} is not supported; remove it")
