"""Validation of the batch-size schedules, checkpoint retention, pipeline layout, rank order,
selective-recompute and run-control flags (called from validate.resolve): --step-batch-size-schedule,
--rampup-batch-size, --save-retain-interval, --use-tp-pp-dp-mapping, --recompute-modules, --exit-signal,
--log-memory-interval and --fim-*. One-line ConfigErrors."""
from __future__ import annotations

import dataclasses
import signal
from typing import Optional

from ..errors import ConfigError

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _number(text: str, schedule: str) -> int:
    """A schedule number: an int or float with an optional K/M/B/T suffix, truncated as Megatron's
    ``int(float(value) * multiplier)``."""
    t = text.strip().upper()
    scale = SUFFIXES.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        raise ConfigError(f"--step-batch-size-schedule {schedule!r}: {text!r} is not a number (K/M/B/T suffixes "
                          "allowed)") from None


def step_schedule(schedule: str, seq_length: Optional[int]) -> list[tuple[int, int]]:
    """``--step-batch-size-schedule`` as [(threshold in samples, global batch size)], sorted: entries
    ``THRESHOLD:BS`` separated by spaces or commas; thresholds are tokens, turned into samples by
    ``// seq_length`` (Megatron passes --seq-length; without one they are samples)."""
    entries = schedule.replace(",", " ").split()
    need(entries, "--step-batch-size-schedule is empty; give entries THRESHOLD:BS, the first at threshold 0")
    out = []
    for entry in entries:
        need(":" in entry, f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        t = _number(threshold, schedule)
        out.append((t // seq_length if seq_length else t, _number(batch, schedule)))
    out.sort(key=lambda e: e[0])
    need(out[0][0] == 0, f"--step-batch-size-schedule {schedule!r}: the first entry must have threshold 0 "
                         f"(the smallest is {out[0][0]} samples)")
    for (a, _), (b, _) in zip(out, out[1:]):
        need(b > a, f"--step-batch-size-schedule {schedule!r}: thresholds must be strictly increasing in samples "
                    f"(two entries fall on {a} samples after dividing tokens by --seq-length)")
    for _, bs in out:
        need(bs > 0, f"--step-batch-size-schedule {schedule!r}: batch sizes must be positive (got {bs})")
    return out


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


def changed_flags(section, prefix: str = "", names: tuple = ()) -> list[str]:
    """The flags of ``section``'s fields (those starting with ``prefix``, or named in ``names``) whose
    values differ from their defaults: what a flag that has no effect without another one checks."""
    return [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(section)
            if ((prefix and f.name.startswith(prefix)) or f.name in names) and getattr(section, f.name) != f.default]


def validate_fim(data) -> None:
    """--fim-*: no effect without --fim-data (a changed one is an error), not with mock data (nothing to
    re-tokenize: Megatron refuses it too), and a fragment rate with --fim-split-sample."""
    if not data.fim_data:
        changed = changed_flags(data, prefix="fim_")
        need(not changed, f"{', '.join(changed)}: no effect without --fim-data; add it or remove them")
        return
    need(not data.mock_data, "--fim-data needs real data (it re-tokenizes text); --mock-data has none")
    need(data.fim_split_sample is None or data.fim_fragment_rate is not None,
         "--fim-split-sample needs --fim-fragment-rate (the chance per fragment)")


def validate_sft(data) -> None:
    """--sft: conversations through a HuggingFace tokenizer (Megatron's SFT tokenizer is one too), real
    JSONL data, not FIM; --sft-tokenizer-prompt-format a known format, and no effect without --sft."""
    from ..data.sft import FORMATS
    if not data.sft:
        changed = changed_flags(data, prefix="sft_")
        need(not changed, f"{', '.join(changed)}: no effect without --sft; add it or remove them")
        return
    need(data.sft_tokenizer_prompt_format in FORMATS, f"--sft-tokenizer-prompt-format must be one of "
         f"{', '.join(FORMATS)} (got {data.sft_tokenizer_prompt_format})")
    need(data.tokenizer_type == "HuggingFaceTokenizer", "--sft renders conversations with a HuggingFace "
         f"tokenizer's vocabulary; give --tokenizer-type HuggingFaceTokenizer (got {data.tokenizer_type})")
    need(not data.mock_data, "--sft reads conversations from JSONL files (--data-path); --mock-data has none")
    need(not data.fim_data, "--sft and --fim-data do not go together: FIM rewrites pretraining text, SFT "
         "samples are conversations")


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


def schedule_of(cfg) -> Optional[list[tuple[int, int]]]:
    """The parsed --step-batch-size-schedule of ``cfg`` (None without one)."""
    tr = cfg.train
    return None if tr.step_batch_size_schedule is None else step_schedule(tr.step_batch_size_schedule,
                                                                          cfg.model.seq_length)


def validate_retention(c) -> None:
    if c.save_retain_interval is None:
        return
    need(c.save_retain_interval > 0, f"--save-retain-interval must be > 0 (got {c.save_retain_interval})")
    if c.save is not None:
        need(c.save_interval is not None and c.save_retain_interval % c.save_interval == 0,
             f"--save-retain-interval {c.save_retain_interval} must be a multiple of --save-interval "
             f"{c.save_interval}")


def validate_recompute(cfg) -> None:
    """--recompute-modules: Megatron's names; the default core_attn; used by --recompute-granularity selective."""
    from ..model.recompute import MISSING, SUPPORTED
    tr, m = cfg.train, cfg.model
    if tr.moe_layer_recompute:  # Megatron's older flag: --recompute-granularity selective --recompute-modules moe
        need(m.num_experts is not None, "--moe-layer-recompute has no effect without --num-experts; remove it")
        tr.recompute_granularity = "selective"
        tr.recompute_modules = list(tr.recompute_modules or []) + ["moe"]
    given = tr.recompute_modules is not None
    # Megatron's YAML test configs write the list as one string "[layernorm mlp]": brackets/commas are separators
    mods = (" ".join(map(str, tr.recompute_modules)).replace("[", " ").replace("]", " ").replace(",", " ").split()
            if given else ["core_attn"])
    need(not given or tr.recompute_granularity == "selective" or tr.recompute_activations,
         "--recompute-modules needs --recompute-granularity selective (full recomputes whole layers)")
    for name in mods:
        need(name not in MISSING, f"--recompute-modules {name}: recomputes {MISSING.get(name)}; remove it")
        need(name in SUPPORTED, f"--recompute-modules {name}: choose from {', '.join(SUPPORTED)}")
    if "moe_act" in mods:
        need(m.moe_grouped_gemm, "--recompute-modules moe_act needs --moe-grouped-gemm (as Megatron)")
    if "shared_experts" in mods:
        need(not (m.moe_shared_expert_intermediate_size and m.moe_shared_expert_overlap),
             "--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap; remove one")
    if {"layernorm", "moe_act"} & set(mods):
        need(not tr.torch_compile, "--recompute-modules layernorm/moe_act (output-discarding recomputation) is not "
                                   "supported with --torch-compile; remove one")
    tr.recompute_modules = mods


def check_mapping(par, world: int) -> None:
    """--use-tp-pp-dp-mapping (DP outermost): Megatron asks the dense and expert data-parallel sizes to be
    equal when PP > 1, so that both layouts have the same pipeline groups."""
    if not par.use_tp_pp_dp_mapping:
        return
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size or tp
    need(pp == 1 or ep * etp == tp * cp,
         f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs expert-TP {etp} x EP {ep} = TP {tp} "
         f"x CP {cp} (equal data-parallel sizes of the dense and expert layers)")


def validate_sched(cfg) -> None:
    validate_schedule(cfg)
    validate_run_control(cfg)
    validate_fim(cfg.data)
    validate_sft(cfg.data)
    validate_retention(cfg.ckpt)
    validate_recompute(cfg)
