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

from ..checkpoint import sharded
from ..checkpoint import state as cstate
from ..checkpoint.compat import check_model_config
from ..checkpoint.pieces import replicated_row
from ..checkpoint.retention import Retention
from ..checkpoint.strictness import apply_strictness
from ..checkpoint.tokenizer_files import save_tokenizer
from ..config import Config, check_resolved
from ..config.batch_schedule import schedule_of
from ..model import moe, mtp
from ..parallel.data import finalize_model_grads, wrap_data_parallel
from ..parallel.dims import ParallelDims
from ..parallel import fp8
from ..parallel.layout import BatchLayout
from ..parallel.pipeline import get_forward_backward_func
from ..parallel.random import rng_state, set_rng_state, set_seed
from ..optim.optimizer import build_optimizer
from ..optim.schedule import build_scheduler
from .distributed import build_dims, checkpoint_group, init_distributed  # noqa: F401  (tests import build_dims here)
from .guards import StepGuard, StopSignal, ignore_signal, kill_workers_at_exit
from .preflight import preflight
from .logger import RunLogger
from .metrics import flops_per_iteration, peak_tflops
from .reporting import Reporter, TimedIterator, wandb_run
from .runtime import GarbageCollection, apply_bf16_matmul_reduction, apply_deterministic_mode, apply_logging_level
from .microbatches import MicroBatches, check_batch_sizes
from .resolve import check_device
from .report import end_of_run
from .evaluation import Evaluation
from .run_control import RunControl
from .watch import ProgressLog, StragglerWatch, check_weight_hashes, profiled, record_memory_history
from .step import (build_model, build_model_chunks, hopper_kernels, loss_func, make_forward_step,  # noqa: F401
                   params_dtype, sum_reports)


class Trainer(Evaluation, RunControl):
    progress: Optional[ProgressLog] = None  # --log-progress (train() opens it)

    def __init__(self, cfg: Config, device: Optional[torch.device] = None, dims: Optional[ParallelDims] = None,
                 data: Optional[tuple] = None):
        """``data`` = (train iterator, valid iterator[, test iterator]) replaces the dataset pipeline (tests use it)."""
        self.start_time = time.time()  # --exit-duration-in-mins counts from start-up, as Megatron's
        self.cfg = cfg
        # first: a signal during set-up is kept too
        self.stop_signal = StopSignal(cfg.train.exit_signal_handler, cfg.train.exit_signal)
        self.device = device or init_distributed(cfg)
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
        self.models = [wrap_data_parallel(m, cfg, self.dims) for m in build_model_chunks(cfg, self.dims, self.device)]
        self.routers = moe.routers(self.models)  # MoE routers (none in a dense model), found once
        self.mtp_blocks = mtp.blocks(self.models)  # multi-token prediction (--mtp-num-layers)
        self.fp8_delayed = fp8.delayed_states(self.models)  # the delayed FP8 recipe's layers (primed after a step)
        self.optimizer = build_optimizer(self.models, cfg, self.dims)
        self.scheduler = build_scheduler(cfg, tr.train_samples or tr.train_iters * tr.global_batch_size)
        self.optimizer.set_lr(*self.scheduler.lrs())
        self.iteration, self.consumed_samples = 0, 0
        self.skipped, self.nan_iters = 0, 0
        self.forward_backward = get_forward_backward_func(self.dims, 60.0 * cfg.parallel.distributed_timeout_minutes)
        self.layout = BatchLayout.from_config(cfg, self.dims, self.device, params_dtype(cfg))
        self.forward_step = make_forward_step(self.layout)
        logging_rank = self.dims.is_logging_rank
        self.log = RunLogger(logging_rank, tr.train_iters, cfg.log.tensorboard_dir,
                             queue_size=cfg.log.tensorboard_queue_size, wandb_run=wandb_run(cfg) if logging_rank else None)
        self.pending_save: Optional[sharded.AsyncSave] = None
        self._pending_skips: Optional[torch.Tensor] = None
        self._pinned: dict = {}  # reused pinned CPU buffers of --async-save
        self.ckpt_group = checkpoint_group(cfg)  # checkpoint collectives run on their own gloo group
        if cfg.ckpt.load:
            self.load(cfg.ckpt.load)
        check_batch_sizes(self.microbatches, self.consumed_samples, self.dims, tr.micro_batch_size, tr.eval_iters > 0)
        self._loaders = () if data is not None else self._build_data()  # close() stops their workers
        data = data if data is not None else self._loaders
        self.train_iter, self.valid_iter = data[:2]
        self.test_iter = data[2] if len(data) > 2 else None
        self.report = Reporter(self)  # TensorBoard/W&B scalars, timers and the log line
        self.straggler = StragglerWatch(cfg.log, self.device, self.dims.rank, self.dims.world_size)  # --log-straggler
        if cfg.log.timing_log_level >= 2:
            self.train_iter = TimedIterator(self.train_iter, self.report.timers)
        self.flops_per_iter = flops_per_iteration(cfg.model, cfg.padded_vocab_size, tr.global_batch_size,
                                                  cfg.model.seq_length)
        self.peak = peak_tflops(self.device)
        self.guard = StepGuard.from_config(cfg, self.dims.rank, self.log.print)
        if tr.fp8_format is not None and self.routers:  # what --fp8-format covers in an MoE model, said once
            self.log.print(" FP8: attention and dense / shared-expert MLP linears; the routed experts' grouped GEMMs "
                           "stay in bf16 (FP8 grouped GEMMs are not implemented yet)")
        self.exit_reason: Optional[str] = None  # why training stopped before --train-iters (the exit line's)

    # ---- set-up pieces -------------------------------------------------------------------------
    def _build_tokenizer(self):
        from ..data import build_tokenizer
        return build_tokenizer(self.cfg.data)  # resolve() stored its vocabulary size in cfg.data.vocab_size

    def _build_data(self):
        from ..data import build_data_iterator, build_train_valid_test_datasets, train_valid_test_num_samples
        cfg, tr = self.cfg, self.cfg.train
        sizes = train_valid_test_num_samples(tr)
        if tr.step_batch_size_schedule is not None:  # enough for the steps the schedule runs (Megatron: iters x gbs)
            sizes[0] = max(sizes[0], self.microbatches.samples_for_iters(tr.train_iters))
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg.data, self.tokenizer, cfg.model.seq_length,
                                                                      tr.seed, sizes)
        signals = tr.exit_signal_handler or tr.exit_signal_handler_for_dataloader
        if signals and self.cfg.data.num_workers > 0:
            kill_workers_at_exit()
        it = partial(build_data_iterator, micro_batch_size=tr.micro_batch_size, dp_rank=self.dims.dp_rank,
                     dp_size=self.dims.dp, num_workers=self.cfg.data.num_workers,
                     worker_init_fn=partial(ignore_signal, tr.exit_signal) if signals else None,
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
        tr = self.cfg.train
        gbs = self.current_global_batch = self.microbatches.global_batch(self.consumed_samples)
        for m in self.models:
            m.zero_grad_buffer()
        if self.routers:
            moe.before_step(self.routers, self.optimizer.loss_scale, self.num_microbatches, tr.calculate_per_token_loss,
                            self.dims.cp)
        mtp.before_step(self.mtp_blocks, self.optimizer.loss_scale, self.num_microbatches, tr.calculate_per_token_loss)
        timers = self.report.timers
        with timers("forward-backward"), self.straggler.timed():
            reports = self.forward_backward(forward_step_func=self.forward_step, data_iterator=self.train_iter,
                                            model=self.models, num_microbatches=self.num_microbatches,
                                            seq_length=self.cfg.model.seq_length, micro_batch_size=tr.micro_batch_size,
                                            layout=self.layout, forward_only=False,
                                            grad_scale=self.optimizer.loss_scale)
        report = sum_reports(reports, self.device)  # [loss sum, loss tokens] of this rank (last stage; else 0)
        fp8.prime(self.fp8_delayed)  # every delayed FP8 history now holds an amax: scales from it alone
        # --calculate-per-token-loss: the gradients are sums; divide them by the step's global token count
        with timers("all-grads-sync"):
            finalize_model_grads(self.models, self.dims, num_tokens=report[1] if tr.calculate_per_token_loss else None)
        with timers("optimizer"):
            ok, grad_norm = self.optimizer.step()
        if self.routers:  # the expert bias update
            moe.after_step(self.routers, self.dims.dp_group if self.dims.dp > 1 else None)  # CP: the routers' partition
        if isinstance(ok, torch.Tensor) or ok:  # a device-side skip (bf16 inf/nan) still advances, as Megatron's bf16
            self.scheduler.step(gbs)
            self.optimizer.set_lr(*self.scheduler.lrs())
        self.iteration += 1
        self.consumed_samples += gbs
        every = tr.check_weight_hash_across_dp_replicas_interval
        if every and self.iteration % every == 0:  # Megatron's check that the replicas hold the same weights
            check_weight_hashes(self.models, self.dims, self.iteration)
        return self._reduce_dp(report), ok, grad_norm

    def _reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.dp_cp > 1:
            dist.all_reduce(t, group=self.dims.dp_cp_group)
        return t

    # ---- checkpoints (format: paratron/checkpoint/sharded.py and state.py) ------------------------
    def _ckpt_pieces(self, optim: bool, rng: Optional[dict], masters_from: Optional[str] = None,
                     model_prefix: Optional[dict] = None, amax: Optional[torch.Tensor] = None) -> list:
        pieces = cstate.model_pieces(self.models, self.dims, model_prefix)
        if optim:
            cstate.ensure_adam_state(self.optimizer)
            pieces += cstate.optimizer_pieces(self.optimizer, self.models, self.dims, masters_from)
        if rng is not None:
            pieces += cstate.rng_pieces(rng, self.dims)
        if amax is not None:  # the delayed FP8 recipe's amax histories, one row per rank
            pieces.append(replicated_row(cstate.FP8_HISTORY, amax, self.dims.rank, self.dims.world_size))
        return pieces

    def _layout(self) -> dict:
        return cstate.layout(self.dims, self.cfg.parallel.virtual_pipeline_model_parallel_size)

    def _rng_states(self) -> dict:
        states = rng_state(self.device)
        par = self.models[0].module.par
        if par.rng is not None:
            states["tp_region"] = par.rng.state
        if par.expert_rng is not None:  # --moe-router-force-load-balancing
            states["expert_region"] = par.expert_rng.state
        return states

    def save(self) -> Path:
        """Save a checkpoint of this iteration under --save (in the background with --async-save)."""
        c = self.cfg.ckpt
        self.guard.check()  # never a checkpoint of a step whose loss or gradients are not finite
        self.wait_for_save()
        self._fold_pending_skips()
        pieces = self._ckpt_pieces(not c.no_save_optim, None if c.no_save_rng else self._rng_states(),
                                   amax=fp8.histories(fp8.delayed_states(self.models)))
        common = {"consumed_samples": self.consumed_samples, "skipped_iterations": self.skipped,
                  "scheduler": self.scheduler.state_dict(),
                  "optimizer": None if c.no_save_optim else {"step": cstate.adam_step(self.optimizer),
                                                             "scaler": self.optimizer.scaler.state_dict()},
                  "rng": not c.no_save_rng, "layout": self._layout(), "config": self.cfg.to_dict()}
        if self.dims.rank == 0:  # the tokenizer's files beside the weights (generate / serve find them)
            save_tokenizer(c.save, self.cfg.data)
        keep = Retention(c.ckpt_keep_last, c.save_retain_interval)  # which older checkpoints the save removes
        if c.async_save:
            it = self.iteration

            def done(path: Path, seconds: float) -> None:
                self.log.print(f" saved checkpoint at iteration {it:7d} to {path} (in the background, {seconds:.1f} s)")
            self.pending_save = sharded.AsyncSave(c.save, it, pieces, common, self.ckpt_group, keep,
                                                  self._pinned, done)
            path = sharded.iter_dir(c.save, it)
        else:
            path = sharded.save(c.save, self.iteration, pieces, common, self.ckpt_group, keep)
            self.log.print(f" saved checkpoint at iteration {self.iteration:7d} to {path}")
        if self.progress is not None:
            self.progress.saved(self.iteration, self.consumed_samples)
        return path

    def wait_for_save(self) -> None:
        """Block until a background save has finished (its error, if any, is raised here)."""
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.wait()

    def load(self, root: str) -> None:
        """Resume from the latest complete checkpoint under ``root``, in any parallel layout."""
        c = self.cfg.ckpt
        d = sharded.find_checkpoint(root, self.ckpt_group, self.log.print, c.ckpt_step)
        if d is None:
            if c.exit_on_missing_checkpoint:
                raise sharded.CheckpointError(f"no checkpoint found in {root} (--exit-on-missing-checkpoint)")
            self.log.print(f" no checkpoint found in {root}; training from scratch")
            return
        common = sharded.read_common(d)
        check_model_config(common, self.cfg, d, self.log.print)  # before any tensor is read
        saved = sharded.tensor_shapes(d)
        same_layout = common.get("layout") == self._layout()
        optim = not (c.finetune or c.no_load_optim) and common.get("optimizer") is not None
        rng = not (c.finetune or c.no_load_rng) and bool(common.get("rng"))
        if rng and not same_layout:
            self.log.print(f" WARNING: {d} was saved with another parallel layout ({common.get('layout')}): "
                           "the random generators restart from --seed")
            rng = False
        # fp32 weights come from fp32 masters when the checkpoint has them; masters from fp32 weights
        # when it has none (saved without mixed precision).
        masters = "model." if self.optimizer.mixed and not any(k.startswith("optimizer.fp32_param.") for k in saved) \
            else None
        prefix = {k: "optimizer.fp32_param." for p, k in cstate.param_keys(self.models).items()
                  if p.dtype == torch.float32 and f"optimizer.fp32_param.{k}" in saved}
        states = self._rng_states() if rng else None  # overwritten by the load
        amax = self._amax_target(saved, same_layout)
        pieces = apply_strictness(self._ckpt_pieces(optim, states, masters, prefix, amax), saved,
                                  c.dist_ckpt_strictness, self.log.print, self.ckpt_group)
        sharded.load(d, pieces, self.ckpt_group)
        if amax is not None:
            fp8.set_histories(fp8.delayed_states(self.models), amax)
        if optim:
            cstate.set_adam_step(self.optimizer, int(common["optimizer"]["step"]))
            self.optimizer.scaler.load_state_dict(common["optimizer"]["scaler"])
            self.scheduler.resume(common["scheduler"], self.cfg.optim)
            self.optimizer.set_lr(*self.scheduler.lrs())
        else:
            self.optimizer.reload_masters()
        if c.finetune:
            self.log.print(f" loaded weights from {d} (iteration {common['iteration']}) for fine-tuning")
            return
        self.iteration, self.consumed_samples = int(common["iteration"]), int(common["consumed_samples"])
        self.skipped = int(common.get("skipped_iterations", 0))
        if states is not None:  # (the TP-region state was loaded in place: it is the tracker's own tensor)
            set_rng_state(states, self.device)
        self.log.print(f" resumed from {d} at iteration {self.iteration} ({self.consumed_samples} samples)")

    def _amax_target(self, saved: dict, same_layout: bool) -> Optional[torch.Tensor]:
        """Where to load the delayed FP8 recipe's amax histories into; None (they restart) when this
        run has none or the checkpoint has none of this shape (another layout or recipe, a bf16 run)."""
        flat = fp8.histories(fp8.delayed_states(self.models))
        if flat is None:
            return None
        if same_layout and saved.get(cstate.FP8_HISTORY, ((),))[0] == (self.dims.world_size, flat.numel()):
            return torch.empty_like(flat)
        self.log.print(" the checkpoint has no FP8 amax history for this layout and recipe: it restarts")
        return None

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
            if self.valid_iter is not None and self._eval_due():
                valid_loss = self._validate(collector)
            if cfg.ckpt.save and cfg.ckpt.save_interval and self.iteration % cfg.ckpt.save_interval == 0:
                self.save()
                last_saved = self.iteration
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

    def _announce(self) -> None:
        tr, params = self.cfg.train, sum(m.module.num_parameters() for m in self.models)
        self._micro = self.num_microbatches  # (what _save_on_batch_change compares with)
        self.progress = ProgressLog(self.cfg, self.dims.rank, self.dims.world_size, self.flops_per_iter, self.iteration)
        self.log.print(f" training {params / 1e6:.2f}M parameters per rank, {self.dims.describe()}, {tr.train_iters} "
                       f"iterations, global batch {tr.global_batch_size}, {self._micro} micro-batches of "
                       f"{tr.micro_batch_size}, device {self.device}")
        if self.device.type == "cuda":
            self.log.print(f" Hopper kernels: {hopper_kernels(m.module for m in self.models)}")

    def _save_on_batch_change(self, last_saved: Optional[int]) -> Optional[int]:
        """As Megatron: with --save, a checkpoint whenever the batch-size schedule (--rampup-batch-size,
        --step-batch-size-schedule) changes the micro-batch count. Returns the last saved iteration."""
        micro, self._micro = self._micro, self.num_microbatches
        if micro != self._micro and self.cfg.ckpt.save and last_saved != self.iteration:
            self.save()
            return self.iteration
        return last_saved

    def close(self) -> None:
        try:
            self.wait_for_save()
        finally:
            for it in self._loaders:
                if it is not None:
                    it.close()
            self.straggler.close()
            self.log.close()
            if self._root_log_level is not None:  # --logging-level was for this run only
                logging.getLogger().setLevel(self._root_log_level)


def pretrain(cfg: Config, eval_at_start: bool = False) -> dict:
    """Train as ``pretrain_gpt.py`` does; returns the final iteration and loss curves.
    ``eval_at_start`` also measures the validation loss of the untrained model (the demo does)."""
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
