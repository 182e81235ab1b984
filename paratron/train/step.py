"""The model of a rank and the forward step the pipeline schedules call: building the model chunks
(dtype, FP8 recipe, regional compilation) and Megatron's ``forward_step_func`` / ``loss_func``."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..config import Config
from ..kernels import switches
from ..model import moe, recompute
from ..model.bert import BertModel
from ..model.gpt import GPTModel
from ..model.layers import MLP, Attention, Norm
from ..parallel.dims import ParallelDims
from ..fp8.recipe import Recipe
from ..parallel.layout import ID_KEYS, BatchLayout, check_batch_ids
from ..parallel.stages import rank_chunks
from .metrics import flops_per_iteration


def params_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


def resolve_kernels(cfg: Config, device: torch.device) -> Config:
    """``cfg`` with its kernel switches resolved for ``device`` and the run's dtype (each ``auto`` replaced by the
    path that runs: kernels/switches.py), frozen as the rest; ``cfg.kernels.unfrozen()`` gives them as asked.
    The checkpoint's saved config then says what trained the model."""
    return cfg.with_section("kernels", switches.resolve(cfg.kernels, device, params_dtype(cfg),
                                                        cfg.train.deterministic_mode))


def compile_options(device: torch.device, switch: str = "auto") -> dict:
    """Inductor options for the compiled regions. On GPUs, coordinate-descent tuning of the generated
    Triton kernels (norms, GeLU, residual adds): a faster step on gpt-350m on an H100
    (benchmarks/results/train_throughput_gpt-350m_20261122_103813.md), for about a minute more of
    compilation. ``switch``: ``--kernel-compile-coordinate-descent`` (off: an FP8 llama-1b layer has many more
    Triton kernels to tune: its first compile on a fresh machine takes minutes longer with it)."""
    if device.type != "cuda" or switch == "off":
        return {}
    return {"coordinate_descent_tuning": True}


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, **stage) -> GPTModel:
    """``stage``: pre_process / post_process / layer_offset / num_layers of a pipeline chunk."""
    tr = cfg.train
    common = dict(dims=dims, sequence_parallel=cfg.parallel.sequence_parallel, seed=tr.seed,
                  recompute_granularity=tr.recompute_granularity, recompute_method=tr.recompute_method,
                  recompute_num_layers=tr.recompute_num_layers,
                  fp8=Recipe.from_config(tr, cfg.kernels, emulate=device.type == "cpu"),
                  kernels=cfg.kernels, device=device, dtype=params_dtype(cfg), **stage)
    if cfg.model.model == "bert":  # Megatron's BertModel (model/bert.py)
        model = BertModel(cfg.model, cfg.padded_vocab_size, **common)
    else:
        model = GPTModel(cfg.model, cfg.padded_vocab_size, cp_comm_type=cfg.parallel.cp_comm_type, **common)
    model.fused_output_loss = not tr.no_fused_output_loss
    recompute.apply_train_choices(model.decoder, tr, device)  # --recompute-modules, --offload-modules
    if model.embedding is not None:  # --no-token-id-check: the embedding's own check too
        model.embedding.word_embeddings.check_ids = not cfg.data.no_token_id_check
    if tr.torch_compile:
        compile_layers(model, device, cfg.kernels.kernel_compile_coordinate_descent, cfg.kernels.kernel_moe_compile)
    return model


def compile_layers(model: torch.nn.Module, device: torch.device, switch: str = "auto",
                   moe_compile: str = "layer") -> None:
    """--torch-compile: regional compilation, each decoder layer compiled in place (one code object, reused).
    An MoE layer is traced with its decoder layer (``moe_compile`` "layer", --kernel-moe-compile) except the
    paths that read the device on the host (MoELayer._routed); with "experts", and for MoE layers outside the
    decoder layers (MTP's), the layer runs eagerly and its dropless grouped expert path is compiled on its own."""
    for layer in model.decoder.layers:
        layer.compile(options=compile_options(device, switch))
    whole = {id(m) for layer in model.decoder.layers for m in layer.modules()} if moe_compile == "layer" else set()
    for m in model.modules():
        if isinstance(m, moe.MoELayer) and id(m) not in whole:
            m.compile_experts(compile_options(device, switch))


def build_model_chunks(cfg: Config, dims: ParallelDims, device: torch.device) -> list[GPTModel]:
    """This rank's model: one chunk per virtual pipeline stage (a single one without interleaving); T5's (which
    runs without pipelining) one T5Model."""
    if cfg.model.model == "t5":
        from .t5_step import build_t5_model
        return [build_t5_model(cfg, dims, device, params_dtype(cfg))]
    chunks = [build_model(cfg, dims, device, **stage) for stage in rank_chunks(cfg, dims.pp_rank)]
    for c in chunks[1:]:  # one dropout stream for the TP regions of the rank, as with one chunk
        c.par.rng, c.par.expert_rng = chunks[0].par.rng, chunks[0].par.expert_rng
    return chunks


def iteration_flops(cfg: Config) -> float:
    """FLOPs of one iteration at the global batch: GPT's formula (metrics.py), T5's (t5_step.py)."""
    if cfg.model.model == "t5":
        from .t5_step import t5_flops_per_iteration
        return t5_flops_per_iteration(cfg.model, cfg.padded_vocab_size, cfg.train.global_batch_size)
    return flops_per_iteration(cfg.model, cfg.padded_vocab_size, cfg.train.global_batch_size, cfg.model.seq_length)


def hopper_kernels(models) -> str:
    """Which of the optional Hopper kernels (``paratron[hopper]``) the built model takes in training, as the
    start-up line says it: a user can see that the extra is installed and used."""
    mods = [m for model in models for m in model.modules()]
    found = [name for name, hit in (
        ("FlashAttention-4 attention", any(isinstance(m, Attention) and m.flash for m in mods)),
        ("quack gated-GEMM SwiGLU MLP", any(isinstance(m, MLP) and m.gated_gemm for m in mods)),
        ("quack RMSNorm", any(isinstance(m, Norm) and m.quack for m in mods))) if hit]
    if found:
        return ", ".join(found)
    return "none (pip install 'paratron[hopper]' adds FlashAttention-4 and quack's kernels on H100/H200 in bf16)"


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's convention: (sum of masked token losses, token count, report). The token count is
    what the micro-batch's loss is divided by (``BatchLayout.microbatch_loss``); the report's n is the
    same count, so summed over a step it is what --calculate-per-token-loss divides gradients by."""
    mask = loss_mask.float()
    total = (output.float() * mask).sum()
    n = mask.sum()
    return total, n, {"lm loss": torch.stack([total.detach(), n.detach()])}


def bert_loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output):
    """pretrain_bert.py's loss: the masked-LM mean over the masked tokens plus, with the binary head, the
    sentence-order cross-entropy averaged over the micro-batch. As (sum, count, report): the LM sum plus the
    binary loss times the count, so the micro-batch's loss (sum / count) is Megatron's; the report holds the LM
    loss (``lm loss``) and the binary one (``sop loss``, [mean, 1])."""
    lm, binary = output
    total, n, report = loss_func(loss_mask, lm)
    if binary is not None:
        sop = F.cross_entropy(binary.float(), sentence_order.long(), ignore_index=-1)
        total = total + sop * n.clamp(min=1)
        report["sop loss"] = torch.stack([sop.detach(), torch.ones_like(sop.detach())])
    return total, n, report


def make_bert_forward_step(layout: BatchLayout):
    """pretrain_bert.py's forward_step: a BertDataset micro-batch (text, types, labels, is_random, loss_mask,
    padding_mask) on the device through the model (no sequence slicing: BERT refuses context parallelism)."""
    def forward_step(data_iterator, model):
        raw = next(data_iterator)
        check_batch_ids(raw, layout.vocab_size, ID_KEYS["bert"])  # on the loader's host tensors: no device sync
        b = {k: v.to(layout.device, non_blocking=True) for k, v in raw.items()}
        output = model(b["text"], padding_mask=b["padding_mask"], tokentype_ids=b["types"].clamp(min=0),
                       lm_labels=b["labels"])
        return output, partial(bert_loss_func, b["loss_mask"], b["is_random"])
    return forward_step


def make_forward_step(layout: BatchLayout, model: str = "gpt"):
    """Megatron's forward_step_func: the next micro-batch, laid out for this rank by ``layout``
    (device, sequence slice, position ids), through the model; the loss function gets its mask.
    ``model``: --model (bert: ``make_bert_forward_step``; t5: paratron/train/t5_step.py)."""
    if model == "bert":
        return make_bert_forward_step(layout)
    if model == "t5":
        from .t5_step import make_t5_forward_step
        return make_t5_forward_step(layout, loss_func)

    def forward_step(data_iterator, model):
        b = layout.prepare(next(data_iterator))
        output = model(b["tokens"], position_ids=b["position_ids"], attention_mask=b["attention_mask"],
                       labels=b["labels"], document_ids=b["document_ids"], loss_mask=b["loss_mask"])
        return output, partial(loss_func, b["loss_mask"])
    return forward_step


def sum_reports(reports: list[dict], device: torch.device) -> torch.Tensor:
    total = torch.zeros(2, device=device)
    for r in reports:
        total += r["lm loss"].to(device)
    return total
