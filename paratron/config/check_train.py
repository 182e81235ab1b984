"""Checks of the train section: precision, length, recomputation (--recompute-modules), FP8's flags and
layer sizes, the batch-size schedules (--rampup-batch-size, --step-batch-size-schedule) and the run-control
flags (--exit-signal, --iterations-to-skip, --dataloader-type, memory and straggler logging)."""
from __future__ import annotations

import signal

from .batch_schedule import step_schedule
from .precision_file import fp8_recipes
from .rules import changed_flags, listed, need
from .sections import Config, TrainConfig
from .values import (BLOCKWISE_TILE, FP8_AMAX_ALGOS, FP8_FORMATS, FP8_RECIPES, FP8_REFUSED_RECIPES, RECOMPUTE_MISSING,
                     RECOMPUTE_SUPPORTED)


def validate_train(tr: TrainConfig) -> None:
    need(not (tr.bf16 and tr.fp16), "--bf16 and --fp16 are mutually exclusive; choose one")
    need(tr.train_iters is None or tr.train_samples is None,
         "--train-iters and --train-samples are mutually exclusive; choose one")
    need(tr.train_iters is not None or tr.train_samples is not None,
         "set the length of training with --train-iters N or --train-samples N")
    if tr.recompute_activations:
        tr.recompute_granularity = "selective"
    need(tr.recompute_granularity in (None, "full", "selective"),
         "--recompute-granularity must be full or selective")
    if tr.recompute_granularity == "full":
        need(tr.recompute_method in ("uniform", "block"),
             "--recompute-granularity full needs --recompute-method uniform|block")
    need(tr.device in (None, "cuda", "cpu"), f"--device must be cuda or cpu (got {tr.device})")
    need(tr.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0 (got {tr.manual_gc_interval})")
    need(tr.empty_unused_memory_level in (0, 1, 2),
         f"--empty-unused-memory-level must be 0, 1 or 2 (got {tr.empty_unused_memory_level})")
    need(tr.check_for_spiky_loss or not tr.exit_on_spiky_loss, "--exit-on-spiky-loss needs --check-for-spiky-loss")
    validate_rampup(tr)


def validate_rampup(tr) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES against --global-batch-size (Megatron's rules)."""
    if tr.rampup_batch_size is None:
        return
    need(len(tr.rampup_batch_size) == 3, "--rampup-batch-size takes START INCREMENT SAMPLES")
    tr.rampup_batch_size = [int(v) for v in tr.rampup_batch_size]
    start, inc, samples = tr.rampup_batch_size
    need(tr.global_batch_size is not None, "--rampup-batch-size needs --global-batch-size (the final batch size)")
    need(start >= 1 and inc >= 1 and samples >= 0,
         f"--rampup-batch-size {start} {inc} {samples}: START and INCREMENT must be >= 1, SAMPLES >= 0")
    need(start <= tr.global_batch_size and (tr.global_batch_size - start) % inc == 0,
         f"--rampup-batch-size: --global-batch-size {tr.global_batch_size} minus START {start} must be a "
         f"non-negative multiple of INCREMENT {inc}")


def validate_schedule(cfg) -> None:
    tr = cfg.train
    if tr.step_batch_size_schedule is None:
        return
    steps = step_schedule(tr.step_batch_size_schedule, cfg.model.seq_length)
    need(tr.rampup_batch_size is None, "--step-batch-size-schedule and --rampup-batch-size are mutually exclusive; "
                                       "choose one")
    final = steps[-1][1]
    # Megatron refuses any --global-batch-size with a schedule (its own 175B example gives one equal to the
    # final size); paratron takes the final size and refuses only a different one.
    need(tr.global_batch_size in (None, final),
         f"--global-batch-size {tr.global_batch_size} contradicts --step-batch-size-schedule, whose final batch "
         f"size is {final}; remove --global-batch-size")


def schedule_batches(cfg, data_parallel_size: int) -> None:
    """The final scheduled batch must split into micro-batches over the data-parallel ranks (earlier
    entries are checked when training starts from its consumed samples, as Megatron allows entries
    that a resumed, larger run has passed)."""
    tr = cfg.train
    if tr.step_batch_size_schedule is None:
        return
    final = step_schedule(tr.step_batch_size_schedule, cfg.model.seq_length)[-1][1]
    per_step = tr.micro_batch_size * data_parallel_size
    need(final % per_step == 0, f"--step-batch-size-schedule: the final batch size {final} is not divisible by "
                                f"--micro-batch-size {tr.micro_batch_size} x data-parallel size {data_parallel_size}")


def validate_fp8(cfg: Config) -> None:
    """--fp8-*: values, --bf16, layer sizes that FP8 GEMMs take (multiples of 16); the device is the run's
    (paratron/train/resolve.py checks it)."""
    tr, m, par = cfg.train, cfg.model, cfg.parallel
    if tr.fp8_hybrid:
        need(tr.fp8_format in (None, "hybrid"), f"--fp8-hybrid contradicts --fp8-format {tr.fp8_format}; choose one")
        tr.fp8_format = "hybrid"
    if tr.first_last_layers_bf16:
        start, end = tr.num_layers_at_start_in_bf16, tr.num_layers_at_end_in_bf16
        need(tr.fp8_format is not None, "--first-last-layers-bf16 has no effect without --fp8-format; add it or "
             "remove the flag")
        need(start + end <= m.num_layers, f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 "
             f"{end} must together be at most --num-layers {m.num_layers}")
    need(tr.fp8_format is not None or not tr.no_fp8_wgrad, "--no-fp8-wgrad has no effect without --fp8-format; add it "
         "or remove the flag")
    need(tr.fp8_format is not None or tr.te_precision_config_file is None, "--te-precision-config-file overrides "
         "the precision of the modules --fp8-format quantises, and has no effect without it; add --fp8-format")
    if tr.fp8_format is None:
        return
    recipes = fp8_recipes(tr)
    need(tr.fp8_format in FP8_FORMATS, f"--fp8-format must be e4m3 or hybrid (got {tr.fp8_format})")
    need(tr.fp8_recipe not in FP8_REFUSED_RECIPES,
         f"--fp8-recipe {tr.fp8_recipe} is not supported: {FP8_REFUSED_RECIPES.get(tr.fp8_recipe)}; "
         "use tensorwise, delayed or blockwise")
    need(tr.fp8_recipe in FP8_RECIPES, f"--fp8-recipe must be tensorwise, delayed or blockwise (got {tr.fp8_recipe})")
    need("blockwise" not in recipes or tr.fp8_format == "e4m3", f"{_named('blockwise', tr)} keeps every tensor in "
         "e4m3 (DeepSeek-V3's recipe, as Transformer Engine's); use --fp8-format e4m3")
    need(tr.fp8_amax_compute_algo in FP8_AMAX_ALGOS,
         f"--fp8-amax-compute-algo must be max or most_recent (got {tr.fp8_amax_compute_algo})")
    need(not tr.fp16, "--fp8-format with --fp16 is not supported (fp16 weights and loss scaling); use --bf16, or "
         "neither for fp32 weights")
    need(not ("delayed" in recipes and tr.recompute_granularity == "full"),
         f"{_named('delayed', tr)} with --recompute-granularity full would record each amax twice and recompute "
         "with other scales; use --fp8-recipe tensorwise or selective recomputation")
    tp, width = par.tensor_model_parallel_size, m.ffn_hidden_size * (2 if m.swiglu or m.quick_geglu else 1)
    heads = m.num_attention_heads * (2 if m.attention_output_gate else 1)
    sizes = {"--hidden-size": m.hidden_size, "QKV output per TP rank": (heads + 2 * m.num_query_groups)
             * m.kv_channels // tp, "attention width per TP rank": m.num_attention_heads * m.kv_channels // tp,
             "fc1 output per TP rank": width // tp, "--ffn-hidden-size per TP rank": m.ffn_hidden_size // tp,
             "tokens per micro-batch (--micro-batch-size x --seq-length / CP)":
                 tr.micro_batch_size * m.seq_length // par.context_parallel_size}
    if m.num_experts is not None:
        sizes["--moe-ffn-hidden-size per expert-TP rank"] = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // (
            par.expert_tensor_parallel_size or tp)
    align = BLOCKWISE_TILE if "blockwise" in recipes else 16  # blockwise: whole tiles (cuBLAS's blockwise GEMM)
    for name, size in sizes.items():
        within = f" with {_named('blockwise', tr)}" if align == BLOCKWISE_TILE else ""
        need(size % align == 0, f"--fp8-format{within} needs FP8 GEMM sizes that are multiples of {align}; {name} is "
                                f"{size}")


def validate_recompute(cfg) -> None:
    """--recompute-modules: Megatron's names; the default core_attn; used by --recompute-granularity selective."""
    tr, m = cfg.train, cfg.model
    if tr.moe_layer_recompute:  # Megatron's older flag: --recompute-granularity selective --recompute-modules moe
        need(m.num_experts is not None, "--moe-layer-recompute has no effect without --num-experts; remove it")
        tr.recompute_granularity = "selective"
        tr.recompute_modules = list(tr.recompute_modules or []) + ["moe"]
    given = tr.recompute_modules is not None
    mods = listed(tr.recompute_modules) if given else ["core_attn"]
    need(not given or tr.recompute_granularity == "selective" or tr.recompute_activations,
         "--recompute-modules needs --recompute-granularity selective (full recomputes whole layers)")
    for name in mods:
        need(name not in RECOMPUTE_MISSING,
             f"--recompute-modules {name}: recomputes {RECOMPUTE_MISSING.get(name)}; remove it")
        need(name in RECOMPUTE_SUPPORTED, f"--recompute-modules {name}: choose from {', '.join(RECOMPUTE_SUPPORTED)}")
    if "moe_act" in mods:
        need(m.moe_grouped_gemm, "--recompute-modules moe_act needs --moe-grouped-gemm (as Megatron)")
    if "shared_experts" in mods:
        need(not (m.moe_shared_expert_intermediate_size and m.moe_shared_expert_overlap),
             "--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap; remove one")
    if "mla_up_proj" in mods:
        need(m.multi_latent_attention, "--recompute-modules mla_up_proj recomputes multi-latent attention's up "
             "projections: it needs --multi-latent-attention; remove it")
        need(tr.fp8_format is None or tr.fp8_recipe != "delayed", "--recompute-modules mla_up_proj with --fp8-recipe "
             "delayed: the recomputed projections would record their amaxes twice; use tensorwise or blockwise")
    if {"layernorm", "moe_act", "mla_up_proj"} & set(mods):
        need(not tr.torch_compile, "--recompute-modules layernorm/moe_act/mla_up_proj (output-discarding "
                                   "recomputation) is not supported with --torch-compile; remove one")
    tr.recompute_modules = mods


def validate_run_control(cfg) -> None:
    """--exit-signal: a signal name that can be caught (Megatron takes any signal.Signals name);
    --log-memory-interval: a multiple of --log-interval (Megatron's assertion); the --straggler-* flags
    need --log-straggler."""
    tr, interval = cfg.train, cfg.log.log_memory_interval
    need(tr.exit_signal in signal.Signals.__members__ and tr.exit_signal not in ("SIGKILL", "SIGSTOP"),
         f"--exit-signal {tr.exit_signal} is not a signal a process can catch; use a name such as SIGTERM, SIGINT, "
         "SIGUSR1 or SIGUSR2")
    need(interval is None or interval % cfg.log.log_interval == 0,
         f"--log-memory-interval {interval} must be a multiple of --log-interval {cfg.log.log_interval}")
    if tr.iterations_to_skip is not None:
        words = [str(v) for v in tr.iterations_to_skip]
        need(all(w.isdigit() and int(w) >= 1 for w in words),
             f"--iterations-to-skip takes step numbers >= 1 (got {' '.join(words)})")
        tr.iterations_to_skip = sorted({int(w) for w in words})
    kind = cfg.data.dataloader_type
    need(kind != "external", "--dataloader-type external (a loader of your own) is not a command-line option in "
         "paratron: pass your iterators to paratron.train.loop.Trainer(cfg, data=(train, valid)) instead")
    need(kind in (None, "single", "cyclic"), f"--dataloader-type must be single or cyclic (got {kind})")
    need(kind == "cyclic" or not cfg.data.no_data_sharding, "--no-data-sharding has no effect without "
         "--dataloader-type cyclic; add it or remove the flag")
    lg = cfg.log
    need(lg.record_memory_history or not changed_flags(lg, names=("memory_snapshot_path",)),
         "--memory-snapshot-path has no effect without --record-memory-history; add it or remove the flag")
    if lg.record_memory_history:
        import torch
        need(cfg.train.device != "cpu" and torch.cuda.is_available(), "--record-memory-history records the CUDA "
             "caching allocator; this run is on the CPU: remove the flag")
    extra = changed_flags(lg, names=("disable_straggler_on_startup", "straggler_minmax_count", "straggler_ctrlr_port"))
    need(lg.log_straggler or not extra, f"{', '.join(extra)}: no effect without --log-straggler; add it or remove them")
    need(lg.straggler_ctrlr_port <= 65535, f"--straggler-ctrlr-port {lg.straggler_ctrlr_port} is not a TCP port")


def validate_run_variants(cfg: Config) -> None:
    """Checks that need two sections: the bf16 matmul switch, --log-progress's file."""
    need(not cfg.train.disable_bf16_reduced_precision_matmul or cfg.train.bf16,
         "--disable-bf16-reduced-precision-matmul needs --bf16 (it changes bf16 matmuls only)")
    need(not cfg.log.log_progress or cfg.ckpt.save, "--log-progress writes <save>/progress.txt: add --save DIR")


def _named(recipe: str, tr: TrainConfig) -> str:
    """How an error names where ``recipe`` comes from: the run's --fp8-recipe, else the precision file."""
    return f"--fp8-recipe {recipe}" if tr.fp8_recipe == recipe else f"the {recipe} recipe of --te-precision-config-file"
