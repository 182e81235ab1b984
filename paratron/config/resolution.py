"""``resolve()``: validate each section, compute every derived value once, then freeze the config.

Derived here and nowhere else: the head dim, FFN size, query groups and max positions (model); the
virtual pipeline size from ``--num-layers-per-virtual-pipeline-stage``; sequence parallelism off at
TP 1 (as Megatron); the recompute granularity of ``--recompute-activations``; the NullTokenizer
default of mock data; from the world size, the data-parallel size, the global batch default and
``--train-iters`` of ``--train-samples``; and the vocabulary size of the tokenizer. After
``resolve()`` no module writes to the config (a write raises FrozenConfigError).

This package reads no file but the YAML it is given: the vocabulary size of a tokenizer that has files,
the checkpoint of ``--use-checkpoint-args`` and the device FP8 needs are the run's facts, which
:mod:`paratron.train.resolve` passes in (``resolve(cfg, vocab_size=..., checks=...)``); ``paratron
train`` resolves with it. The checks of each section live in ``check_<section>.py``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
from typing import Callable, Iterable, Optional

from ..errors import UserError
from .batch_schedule import MicroBatches, schedule_of
from .check_ckpt import validate_ckpt, validate_retention
from .check_bert import default_tokenizer, validate_model_family
from .check_data import validate_data, validate_fim, validate_sft
from .check_log import validate_log
from .check_t5 import validate_t5
from .check_model import validate_model, validate_mtp
from .check_moe import validate_combined_overlap, validate_routing_parallel
from .check_graphs import validate_graphs
from .check_offload import validate_activation_offload
from .check_optim import validate_optim, validate_optimizer
from .check_parallel import check_mapping, validate_parallel, validate_sample
from .kernels import check_kernels
from .check_train import (schedule_batches, validate_fp8, validate_recompute, validate_run_control,
                          validate_run_variants, validate_schedule, validate_train)
from .ranges import check_ranges
from .rules import ConfigProblems, need
from .sections import SECTIONS, Config, DataConfig, ModelConfig


def _values(section) -> dict:
    return {f.name: copy.copy(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _freeze(section, given: dict) -> None:
    section._freeze({k: v for k, v in given.items() if getattr(section, k) != v})


def resolve_model(m: ModelConfig) -> ModelConfig:
    """A model config on its own (GPTModel, HF conversion): validated, derived values filled, frozen."""
    given = _values(m)
    check_ranges(m)
    validate_model(m)
    _freeze(m, given)
    return m


# ---- values that need the world size or the tokenizer ------------------------------------------
def world_size_default() -> int:
    """torch.distributed's world size when it is initialised, else torchrun's WORLD_SIZE, else 1."""
    dist = sys.modules.get("torch.distributed")  # never imported just for this
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_batch(cfg: Config, data_parallel_size: int) -> None:
    """Check that the global batch (and a ramp's sizes) split into micro-batches over ``data_parallel_size``
    data-parallel ranks; every problem together. Writes nothing."""
    tr = cfg.train
    per_step = tr.micro_batch_size * data_parallel_size
    gbs = tr.global_batch_size if tr.global_batch_size is not None else per_step

    def ramp() -> None:
        if tr.rampup_batch_size is not None:
            start, inc, _ = tr.rampup_batch_size
            need(start % per_step == 0 and inc % per_step == 0,
                 f"--rampup-batch-size START {start} and INCREMENT {inc} must be multiples of --micro-batch-size "
                 f"{tr.micro_batch_size} x data-parallel size {data_parallel_size}")
    _run_all([lambda: need(gbs % per_step == 0,
                           f"--global-batch-size {gbs} is not divisible by --micro-batch-size {tr.micro_batch_size} "
                           f"x data-parallel size {data_parallel_size}; adjust one of them"),
              lambda: schedule_batches(cfg, data_parallel_size), ramp])


def check_world(cfg: Config, world: int) -> None:
    """Every problem of the parallel sizes and the batch sizes against ``world`` processes, together
    (the batch sizes only when the world splits into data-parallel ranks). Writes nothing."""
    par = cfg.parallel
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    splits = world >= 1 and world % (tp * pp * cp) == 0
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size or tp
    _run_all([lambda: need(splits, f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp} = "
                                   f"{tp * pp * cp}; change the parallel sizes or the number of processes"),
              lambda: need((world // pp) % (ep * etp) == 0,
                           f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not divide "
                           f"the {world // pp} ranks of a pipeline stage (world size {world} / PP {pp}); change the "
                           "expert-parallel sizes"),
              lambda: check_mapping(par, world),
              lambda: resolve_batch(cfg, world // (tp * pp * cp)) if splits else None])


def resolve_world(cfg: Config, world: int) -> None:
    """The data-parallel size of ``world`` processes; the global batch default; --train-iters of --train-samples."""
    par, tr = cfg.parallel, cfg.train
    check_world(cfg, world)
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size)
    if tr.global_batch_size is None:
        tr.global_batch_size = tr.micro_batch_size * dp
    if tr.train_iters is None:
        micro = MicroBatches(tr.global_batch_size, tr.micro_batch_size, dp, tr.rampup_batch_size, schedule_of(cfg))
        tr.train_iters = micro.train_iters_for_samples(tr.train_samples)
    cfg.world_size = world


def declared_vocab_size(d: DataConfig) -> int:
    """The vocabulary size the config itself holds: a NullTokenizer's --vocab-size. Any other tokenizer
    has it in its files, which this package does not open (the default of ``resolve``'s ``vocab_size``)."""
    need(d.tokenizer_type == "NullTokenizer", f"--tokenizer-type {d.tokenizer_type}: its vocabulary size is in "
         "its files, which paratron.config does not read; resolve with paratron.train.resolve.resolve(cfg) or "
         "parse with paratron.train.resolve.parse_args (as `paratron train` does)")
    return d.vocab_size


def _set_vocab(cfg: Config, vocab_size) -> None:
    cfg.data.vocab_size = vocab_size(cfg.data)
    padded, tp = cfg.data.padded_vocab_size, cfg.parallel.tensor_model_parallel_size
    if padded is not None:  # --padded-vocab-size: the model's rows as given, checked against the tokenizer and TP
        need(padded >= cfg.data.vocab_size and padded % tp == 0, f"--padded-vocab-size {padded} must be at least the "
             f"tokenizer's {cfg.data.vocab_size} tokens and divisible by --tensor-model-parallel-size {tp}")


def _run_all(steps) -> None:
    """Run every validation step; report the problem of each step together (ConfigProblems). An
    error that follows an earlier problem (a value the failed step did not derive) is not reported."""
    errors = []
    for step in steps:
        try:
            step()
        except UserError as e:
            errors.append(e)
        except Exception:
            if not errors:
                raise
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems([p for e in errors for p in (e.problems if isinstance(e, ConfigProblems) else [str(e)])])


def validate_across(cfg: Config) -> None:
    """The checks that read several sections, in one step (the first problem stops it)."""
    validate_schedule(cfg)
    validate_run_control(cfg)
    validate_fim(cfg.data)
    validate_sft(cfg.data)
    validate_retention(cfg.ckpt)
    validate_recompute(cfg)
    validate_activation_offload(cfg)
    validate_graphs(cfg)
    validate_model_family(cfg)
    validate_t5(cfg)


def resolve(cfg: Config, world_size: Optional[int] = None, *,
            vocab_size: Callable[[DataConfig], int] = declared_vocab_size,
            checks: Iterable[Callable[[Config], None]] = ()) -> Config:
    """Validate ``cfg`` section by section, compute every derived value, and freeze it (in place; also
    returned). ``world_size``: the number of processes of the run (default: ``cfg.world_size`` if set,
    else :func:`world_size_default`). ``vocab_size``: the tokenizer's vocabulary size of the data section
    (default: a NullTokenizer's --vocab-size, see :func:`declared_vocab_size`); ``checks``: more checks of
    the whole config, run once its sections are valid (paratron.train.resolve passes the device's). Raises
    ConfigError (or DataError for tokenizer files) with one line; on an error ``cfg`` is left as it was
    given. A resolved config is returned as it is."""
    if cfg.is_resolved:
        need(world_size is None or world_size == cfg.world_size,
             f"the config was resolved for world size {cfg.world_size}, not {world_size}; resolve a copy: "
             f"resolve(cfg.unfrozen(), world_size={world_size})")
        return cfg
    world = world_size or cfg.world_size or world_size_default()
    given = {name: _values(getattr(cfg, name)) for name in SECTIONS}
    given_world = cfg.world_size
    steps = (lambda: validate_optimizer(cfg), lambda: validate_run_variants(cfg), lambda: validate_model(cfg.model),
             lambda: validate_parallel(cfg.parallel, cfg.model, cfg.train),
             lambda: validate_train(cfg.train), lambda: validate_fp8(cfg), lambda: validate_optim(cfg.optim),
             lambda: validate_ckpt(cfg.ckpt), lambda: validate_log(cfg.log),
             lambda: validate_data(cfg.data, default_tokenizer(cfg.model)),
             lambda: validate_across(cfg),
             lambda: validate_routing_parallel(cfg.parallel, cfg.model, cfg.log), lambda: validate_mtp(cfg),
             lambda: validate_combined_overlap(cfg),
             lambda: check_kernels(cfg.kernels), lambda: validate_sample(cfg),
             lambda: check_world(cfg, world))  # the world's and the batch's problems with the others
    try:
        _run_all([lambda name=name: check_ranges(getattr(cfg, name)) for name in SECTIONS])  # numbers first
        _run_all(steps)  # each section's problem, together
        resolve_world(cfg, world)  # needs every section valid
        _set_vocab(cfg, vocab_size)
        _run_all([lambda check=check: check(cfg) for check in checks])
    except Exception:
        for name, values in given.items():
            for key, value in values.items():
                setattr(getattr(cfg, name), key, value)
        cfg.world_size = given_world
        raise
    for name in SECTIONS:
        _freeze(getattr(cfg, name), given[name])
    cfg._freeze({})
    return cfg


finalize = resolve  # the former name


finalize = resolve  # the former name


def check_resolved(cfg: Config, world_size: int) -> None:
    """What a run needs of its config: resolved, for this many processes."""
    need(cfg.is_resolved, "the config is not resolved: call paratron.config.resolve(cfg) (parse_args does) first")
    need(cfg.world_size == world_size,
         f"the config was resolved for world size {cfg.world_size} but this run has {world_size} processes; "
         f"resolve it with resolve(cfg, world_size={world_size})")
