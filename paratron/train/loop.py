"""The training loop: set up, then ``train_step`` until done, with evaluation, checkpoints, logs and
exit conditions. Read top to bottom; each parallelism lives in paratron/parallel/."""
from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config, check_resolved
from ..config.batch_schedule import schedule_of
from ..parallel.data import finalize_model_grads, wrap_chunks
from ..parallel.dims import ParallelDims
from ..kernels import switches
from ..parallel.layout import BatchLayout
from ..parallel.pipeline import get_forward_backward_func
from ..parallel.random import set_seed
from ..optim.optimizer import build_optimizer
from ..optim.schedule import build_scheduler
from .distributed import build_dims, init_distributed  # noqa: F401  (tests import build_dims here)
from .energy import EnergyMeter
from .guards import StepGuard, StopSignal, data_worker_init, kill_workers_at_exit
from .preflight import preflight
from .logger import RunLogger
from .metrics import peak_tflops
from ..plan.memory import dry_run, startup_lines as memory_lines
from .reporting import Reporter, TimedIterator, wandb_run
from .runtime import GarbageCollection, apply_bf16_matmul_reduction, apply_deterministic_mode, apply_logging_level
from .microbatches import MicroBatches, check_batch_sizes
from .resolve import check_device
from .report import check_sample_prompt, end_of_run
from .checkpointing import Checkpointing
from .evaluation import Evaluation
from .hooks import StepContext, StepHooks
from .run_control import RunControl
from .step_graph import step_graph
from .watch import ProgressLog, StragglerWatch, check_weight_hashes, profiled, record_memory_history
from .step import (build_model, build_model_chunks, hopper_kernels, iteration_flops, loss_func,  # noqa: F401
                   make_forward_step, params_dtype, resolve_kernels, sum_reports)

class Trainer(Checkpointing, Evaluation, RunControl):
    progress: Optional[ProgressLog] = None  # --log-progress (train() opens it)

    def __init__(self, cfg: Config, device: Optional[torch.device] = None, dims: Optional[ParallelDims] = None,
                 data: Optional[tuple] = None):
        """``data`` = (train iterator, valid iterator[, test iterator]) replaces the dataset pipeline (tests use it)."""
        self.start_time = time.time()  # --exit-duration-in-mins counts from start-up, as Megatron's
        self.cfg = cfg
        # first: a signal during set-up is kept too
        self.stop_signal = StopSignal(cfg.train.exit_signal_handler, cfg.train.exit_signal)
        self.device = device or init_distributed(cfg)
        self.kernels_asked = cfg.kernels  # the switches as given; cfg.kernels below: as they run here
        self.cfg = cfg = resolve_kernels(cfg, self.device)
        self.dims = dims or build_dims(cfg)
        self.memory_history = record_memory_history(cfg.log, self.dims.rank)  # before the model exists
        check_resolved(cfg, self.dims.world_size)  # derived values (global batch, train iters, vocab) are in cfg
        check_device(cfg)  # (a config resolved by paratron.config alone was not)
        preflight(cfg, self.dims, partial(print, flush=True))  # --save and the other output directories, now
        tr = cfg.train
        self.microbatches = MicroBatches(tr.global_batch_size, tr.micro_batch_size, self.dims.dp, tr.rampup_batch_size,
                                         schedule_of(cfg), tr.eval_global_batch_size)
        self.current_global_batch = tr.global_batch_size
        set_seed(tr.seed, self.dims.pp_rank)
        apply_deterministic_mode(tr.deterministic_mode)
        apply_bf16_matmul_reduction(cfg)
        self._root_log_level = apply_logging_level(cfg.log.logging_level)
        self.tokenizer = self._build_tokenizer()
        self.models = wrap_chunks(build_model_chunks(cfg, self.dims, self.device), cfg, self.dims)
        self.hooks = StepHooks(self.models)  # MoE routers, MTP blocks, delayed FP8 scalers: registered once
        self.optimizer = build_optimizer(self.models, cfg, self.dims)
        self.scheduler = build_scheduler(cfg, tr.train_samples or tr.train_iters * tr.global_batch_size)
        self.optimizer.set_lr(*self.scheduler.lrs())
        self.iteration, self.consumed_samples = 0, 0
        self.skipped, self.nan_iters = 0, 0
        self.forward_backward = get_forward_backward_func(self.dims, 60.0 * cfg.parallel.distributed_timeout_minutes,
                                                          cfg.model.overlap_moe_expert_parallel_comm)
        self.layout = BatchLayout.from_config(cfg, self.dims, self.device, params_dtype(cfg))
        self.forward_step = make_forward_step(self.layout, cfg.model.model)
        logging_rank = self.dims.is_logging_rank
        self.log = RunLogger(logging_rank, tr.train_iters, cfg.log.tensorboard_dir,
                             queue_size=cfg.log.tensorboard_queue_size, wandb_run=wandb_run(cfg) if logging_rank else None)
        self._pending_skips: Optional[torch.Tensor] = None
        self.step_graph = step_graph(cfg, self.device, self.models, self.layout, self.log.print)  # (or None)
        self._init_checkpointing()
        if cfg.ckpt.load or cfg.ckpt.pretrained_checkpoint:
            self.load(cfg.ckpt.load)
        check_batch_sizes(self.microbatches, self.consumed_samples, self.dims, tr.micro_batch_size, tr.eval_iters > 0)
        self._loaders = () if data is not None else self._build_data()  # close() stops their workers
        data = data if data is not None else self._loaders
        self.train_iter, self.valid_iter = data[:2]
        self.test_iter = data[2] if len(data) > 2 else None
        self.report = Reporter(self)  # TensorBoard/W&B scalars, timers and the log line
        self.straggler = StragglerWatch(cfg.log, self.device, self.dims.rank, self.dims.world_size)  # --log-straggler
        self.energy = EnergyMeter(self.device) if cfg.log.log_energy else None  # --log-energy
        if cfg.log.timing_log_level >= 2:
            self.train_iter = TimedIterator(self.train_iter, self.report.timers)
        self.flops_per_iter = iteration_flops(cfg)
        self.peak = peak_tflops(self.device)
        self.guard = StepGuard.from_config(cfg, self.dims.rank, self.log.print)
        if tr.fp8_format is not None:  # what --fp8-format covers on this rank, said once
            from .. import fp8
            self.log.print(fp8.startup_line(self.models, tr.bf16, self.device))
        self.exit_reason: Optional[str] = None  # why training stopped before --train-iters (the exit line's)

    # ---- set-up pieces -------------------------------------------------------------------------
    def _build_tokenizer(self):
        from ..data import build_tokenizer
        tokenizer = build_tokenizer(self.cfg.data)  # resolve() stored its vocabulary size in cfg.data.vocab_size
        check_sample_prompt(self.cfg, tokenizer)  # at start-up, not after the run
        return tokenizer

    def _build_data(self):
        from ..data import build_data_iterator, build_train_valid_test_datasets, train_valid_test_num_samples
        cfg, tr = self.cfg, self.cfg.train
        sizes = train_valid_test_num_samples(tr)
        if tr.step_batch_size_schedule is not None:  # enough for the steps the schedule runs (Megatron: iters x gbs)
            sizes[0] = max(sizes[0], self.microbatches.samples_for_iters(tr.train_iters))
        builder = None
        if cfg.model.model == "bert":  # Megatron's BERT samples (data/bert_dataset.py)
            from ..data.bert_dataset import BertDataConfig, bert_builder
            config = BertDataConfig.from_config(cfg.data, cfg.model, self.tokenizer, cfg.model.seq_length, tr.seed)
            builder = bert_builder(config, self.tokenizer)
        elif cfg.model.model == "t5":  # span corruption (data/t5_dataset.py)
            from .t5_step import t5_data_builder
            builder = t5_data_builder(cfg, self.tokenizer)
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg.data, self.tokenizer, cfg.model.seq_length,
                                                                      tr.seed, sizes, make_builder=builder)
        signals = tr.exit_signal_handler or tr.exit_signal_handler_for_dataloader
        if signals and self.cfg.data.num_workers > 0:
            kill_workers_at_exit()
        it = partial(build_data_iterator, micro_batch_size=tr.micro_batch_size, dp_rank=self.dims.dp_rank,
                     dp_size=self.dims.dp, num_workers=self.cfg.data.num_workers,
                     worker_init_fn=partial(data_worker_init, tr.exit_signal if signals else None),
                     cyclic=cfg.data.dataloader_type == "cyclic", data_sharding=not cfg.data.no_data_sharding)
        train = it(train_ds, consumed_samples=self.consumed_samples, infinite=False)
        valid = it(valid_ds, consumed_samples=0, infinite=True) if valid_ds is not None and tr.eval_iters > 0 else None
        test = it(test_ds, consumed_samples=0, infinite=True) if test_ds is not None and tr.eval_iters > 0 else None
        return train, valid, test

    @property
    def model(self):
        """The model of a run without virtual pipeline stages (``models`` holds every chunk)."""
        if len(self.models) != 1:
            raise AttributeError(f"this rank has {len(self.models)} model chunks (virtual pipeline stages); "
                                 "use Trainer.models")
        return self.models[0]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank in the next step (follows --rampup-batch-size)."""
        return self.microbatches.num_microbatches(self.consumed_samples)

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, bool, float]:
        tr, timers = self.cfg.train, self.report.timers
        gbs = self.current_global_batch = self.microbatches.global_batch(self.consumed_samples)
        for m in self.models:
            m.zero_grad_buffer()
        ctx = StepContext(self.optimizer.loss_scale, self.num_microbatches, tr.calculate_per_token_loss, self.dims)
        with timers("forward-backward"), self.straggler.timed():
            if self.step_graph is not None:  # --cuda-graph-impl local: replayed as a CUDA graph (step_graph.py)
                reports = self.step_graph.run(partial(self._passes, ctx), self.train_iter, ctx.num_microbatches,
                                              ctx.loss_scale)
            else:
                reports = self._passes(ctx, self.train_iter)
        self.report.note_extras(reports)  # BERT's sentence-order loss, for the log line
        report = sum_reports(reports, self.device)  # [loss sum, loss tokens] of this rank (last stage; else 0)
        with timers("all-grads-sync"):  # --calculate-per-token-loss: divide the gradient sums by the token count
            finalize_model_grads(self.models, self.dims, num_tokens=report[1] if ctx.per_token_loss else None)
        with timers("optimizer"):
            ok, grad_norm = self.optimizer.step()
        self.hooks.after_step(ctx)  # the MoE routers' expert bias update
        if isinstance(ok, torch.Tensor) or ok:  # a device-side skip (bf16 inf/nan) still advances, as Megatron's bf16
            self.scheduler.step(gbs)
            self.optimizer.set_lr(*self.scheduler.lrs())
        self.iteration += 1
        self.consumed_samples += gbs
        self._check_weight_hashes()
        return self._reduce_dp(report), ok, grad_norm

    def _passes(self, ctx: StepContext, data_iterator) -> list[dict]:
        """The step's forward and backward passes (its micro-batches through the pipeline schedule) with the step
        hooks around them: the micro-batches' loss reports. What --cuda-graph-impl local captures."""
        tr = self.cfg.train
        self.hooks.before_step(ctx)  # the MoE aux losses' and the MTP loss's backward scale, the FP8 weight cache
        reports = self.forward_backward(forward_step_func=self.forward_step, data_iterator=data_iterator,
                                        model=self.models, num_microbatches=ctx.num_microbatches,
                                        seq_length=self.cfg.model.seq_length, micro_batch_size=tr.micro_batch_size,
                                        layout=self.layout, forward_only=False, grad_scale=ctx.loss_scale)
        self.hooks.after_forward_backward(ctx)  # the delayed FP8 scalers: scales from their histories from now on
        return reports

    def _check_weight_hashes(self) -> None:
        """Megatron's check that the data-parallel replicas hold the same weights (every
        --check-weight-hash-across-dp-replicas-interval iterations)."""
        every = self.cfg.train.check_weight_hash_across_dp_replicas_interval
        if every and self.iteration % every == 0:
            check_weight_hashes(self.models, self.dims, self.iteration)

    def _reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.dp_cp > 1:
            dist.all_reduce(t, group=self.dims.dp_cp_group)
        return t

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, tr, lg = self.cfg, self.cfg.train, self.log
        start, step_start = self.start_time, time.time()
        collector = GarbageCollection(tr)
        acc = torch.zeros(2, device=self.device)
        window_iters, window_start = 0, time.time()
        last_saved = valid_loss = profiler = None
        if tr.skip_train:  # --skip-train: the losses of the model as loaded
            return self._evaluate_only()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._announce()
        while self.iteration < tr.train_iters:
            if tr.iterations_to_skip and self.iteration + 1 in tr.iterations_to_skip:
                self._skip_step()
                continue
            last_saved = self._save_on_batch_change(last_saved)
            if cfg.log.profile and self.iteration == cfg.log.profile_step_start and profiled(cfg.log, self.dims.rank):
                profiler = torch.profiler.profile(record_shapes=False, with_stack=False)
                profiler.__enter__()
            report, ok, grad_norm = self.train_step()
            step_seconds, step_start = time.time() - step_start, time.time()
            self.report.after_step(report, grad_norm, step_seconds, collector)
            self.guard.record(self.iteration, report, grad_norm)
            self._count_skip(ok)
            acc += report
            window_iters += 1
            if profiler is not None and self.iteration == cfg.log.profile_step_end:
                profiler.__exit__(None, None, None)
                out = Path(cfg.log.tensorboard_dir or cfg.ckpt.save or ".") / f"profile_rank{self.dims.rank}.json"
                profiler.export_chrome_trace(str(out))
                lg.print(f" wrote profiler trace {out}")
                profiler = None
            lg.advance(1)
            if self.iteration % cfg.log.log_interval == 0:
                self._fold_pending_skips()
                self.report.log_line(acc, window_iters, time.time() - window_start, float(grad_norm))
                acc.zero_()
                window_iters, window_start = 0, time.time()
            valid_loss, last_saved, away = self._evaluate_and_save(collector, valid_loss, last_saved)
            window_start, step_start = window_start + away, step_start + away  # not training time (as Megatron)
            if self._should_exit(start):
                self._log_exit(start)
                break
        self.guard.check()
        self.report.flush()  # the TensorBoard scalars of the steps after the last log line
        if cfg.ckpt.save and last_saved != self.iteration and self.iteration > 0:
            self.save()
        self.wait_for_save()
        if not self.stop_signal.received:  # preempted: the grace period is for the save, not for evaluations
            valid_loss = self._final_evaluations(valid_loss)
        collector.close()
        return {"iteration": self.iteration, "exit_reason": self.exit_reason, "valid_loss": valid_loss,
                "train_curve": lg.train_curve, "valid_curve": lg.valid_curve}

    def _evaluate_and_save(self, collector, valid_loss, last_saved) -> tuple:
        """The evaluation and the checkpoint due after this step: (validation loss, last saved iteration, seconds
        taken), left out of the log line's time and --log-energy's energy."""
        ckpt = self.cfg.ckpt
        evaluate = self.valid_iter is not None and self._eval_due()
        save = bool(ckpt.save and ckpt.save_interval and self.iteration % ckpt.save_interval == 0)
        if not (evaluate or save):  # (most steps: no clock or counter read)
            return valid_loss, last_saved, 0.0
        start, paused = time.time(), self.energy.pause() if self.energy is not None else None
        if evaluate:
            valid_loss = self._validate(collector)
        if save:
            self.save()
            last_saved = self.iteration
        if paused is not None:
            self.energy.resume(paused)
        return valid_loss, last_saved, time.time() - start

    def _announce(self) -> None:
        tr, params = self.cfg.train, sum(m.module.num_parameters() for m in self.models)
        self._micro = self.num_microbatches  # (what _save_on_batch_change compares with)
        self.progress = ProgressLog(self.cfg, self.dims.rank, self.dims.world_size, self.flops_per_iter, self.iteration)
        self.log.print(f" training {params / 1e6:.2f}M parameters per rank, {self.dims.describe()}, {tr.train_iters} "
                       f"iterations, global batch {tr.global_batch_size}, {self._micro} micro-batches of "
                       f"{tr.micro_batch_size}, device {self.device}"
                       + (f" ({threads(torch.get_num_threads())}, --cpu-threads)" if self.device.type == "cpu" else ""))
        for line in memory_lines(self.cfg):  # the fullest pipeline rank's
            self.log.print(line)
        for line in switches.startup_lines(self.kernels_asked, self.cfg.kernels, self.device, params_dtype(self.cfg),
                                           tr.deterministic_mode):
            self.log.print(line)
        if self.device.type == "cuda":
            self.log.print(f" Hopper kernels: {hopper_kernels(m.module for m in self.models)}")

    def close(self) -> None:
        try:
            self.wait_for_save()
        finally:
            for it in self._loaders:
                if it is not None:
                    it.close()
            self.straggler.close()
            if self.energy is not None:
                self.energy.close()
            self.log.close()
            if self._root_log_level is not None:  # --logging-level was for this run only
                logging.getLogger().setLevel(self._root_log_level)


def threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def pretrain(cfg: Config, eval_at_start: bool = False) -> dict:
    """Train as ``pretrain_gpt.py`` does; returns the final iteration and loss curves.
    ``eval_at_start`` also measures the validation loss of the untrained model (the demo does).
    ``--dry-run``: the memory plan of the layout is printed and nothing is built."""
    if cfg.train.dry_run:
        return dry_run(cfg)
    trainer = Trainer(cfg)
    try:
        if eval_at_start and trainer.valid_iter is not None:
            trainer._validate()
        result = trainer.train()
        end_of_run(trainer, result)  # the loss plot, the --sample-prompt sample
        result["trainer"] = trainer
        return result
    finally:
        trainer.close()
