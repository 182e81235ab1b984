"""What a run writes to TensorBoard and Weights & Biases, under Megatron-LM's tags and flags, and the
log line of each --log-interval window.

Every --tensorboard-log-interval iterations (with --tensorboard-dir or --wandb-project):
``learning-rate``, ``batch-size``, ``lm loss`` (and the MoE losses), ``loss-scale`` (unless
--no-log-loss-scale-to-tensorboard), ``grad-norm``, ``world-size`` (--log-world-size-to-tensorboard),
``num-zeros`` (--log-num-zeros-in-grad), ``params-norm`` (--log-params-norm), each also as
``<tag> vs samples`` over consumed samples; ``mem-reserved-bytes``, ``mem-allocated-bytes``,
``mem-max-allocated-bytes``, ``mem-allocated-count`` (--log-memory-to-tensorboard; on a CPU the
process's resident memory, without the count); ``iteration-time``, ``throughput`` (with
--log-throughput) and ``<timer>-time`` for the timers of --timing-log-level
(--log-timers-to-tensorboard). Evaluations write ``lm loss validation`` (+ ``vs samples``) and, with
--log-validation-ppl-to-tensorboard, ``lm loss validation ppl`` (+ ``vs samples``).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..model import moe, mtp
from .logger import format_train_line
from .metrics import peak_memory_gb
from .runtime import empty_unused_memory
from .watch import dump_memory_snapshot

# Megatron's timer names and the --timing-log-level that shows them (paratron times these).
TIMER_LEVELS = {"forward-backward": 1, "all-grads-sync": 1, "optimizer": 1, "batch-generator": 2}
VS_SAMPLES = ("learning-rate", "batch-size", "loss-scale", "world-size", "grad-norm", "num-zeros", "params-norm")


class Timers:
    """Wall-clock timers of Megatron's names, summed until read; a timer above --timing-log-level
    costs nothing. On a GPU each timed region is bracketed by a device synchronisation."""

    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        self.elapsed = {name: 0.0 for name in TIMER_LEVELS if TIMER_LEVELS[name] <= level}

    @contextmanager
    def __call__(self, name: str):
        if name not in self.elapsed:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.elapsed[name] += time.perf_counter() - start

    def take(self, iterations: int) -> dict[str, float]:
        """Seconds per iteration of each timer since the last call, the maximum over ranks (Megatron's
        TensorBoard value); resets them. Every rank calls it."""
        names = sorted(self.elapsed)
        values = torch.tensor([self.elapsed[n] / max(iterations, 1) for n in names], dtype=torch.float64)
        if dist.is_initialized() and names:
            values = values.to(self.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        for n in names:
            self.elapsed[n] = 0.0
        return {f"{n}-time": float(v) for n, v in zip(names, values.tolist())}


class TimedIterator:
    """An iterator whose ``next()`` is timed as Megatron's ``batch-generator``."""

    def __init__(self, it, timers: Timers):
        self.it, self.timers = it, timers

    def __iter__(self):
        return self

    def __next__(self):
        with self.timers("batch-generator"):
            return next(self.it)


def memory_scalars(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": s["reserved_bytes.all.current"],
                "mem-allocated-bytes": s["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": s["allocated_bytes.all.peak"],
                "mem-allocated-count": s["allocation.all.current"]}
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return {}
    peak = peak_memory_gb(device)
    out = {"mem-reserved-bytes": float(rss), "mem-allocated-bytes": float(rss)}
    if peak is not None:
        out["mem-max-allocated-bytes"] = peak * 2**30
    return out


def memory_line(device: torch.device, rank: int, when: str) -> str:
    """Megatron's ``report_memory`` line (--log-memory-interval), in MB: on CUDA the caching allocator's
    allocated / reserved bytes and their peaks; on a CPU the process's resident memory and its peak."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        values = [s["allocated_bytes.all.current"], s["allocated_bytes.all.peak"], s["reserved_bytes.all.current"],
                  s["reserved_bytes.all.peak"]]
    else:
        now = memory_scalars(device).get("mem-allocated-bytes", 0.0)
        peak = (peak_memory_gb(device) or 0.0) * 2**30
        values = [now, peak, now, peak]
    mb = [v / 2**20 for v in values]
    return (f"[Rank {rank}] ({when}) memory (MB) | allocated: {mb[0]:.1f} | max allocated: {mb[1]:.1f} | "
            f"reserved: {mb[2]:.1f} | max reserved: {mb[3]:.1f}")


def wandb_run(cfg):
    """A W&B run of --wandb-project (offline unless WANDB_MODE says otherwise or WANDB_API_KEY is
    set), or None."""
    lg = cfg.log
    if lg.wandb_project is None:
        return None
    try:
        import wandb
    except ImportError:
        raise ConfigError("--wandb-project needs the wandb package: pip install 'paratron[wandb]'") from None
    save_dir = lg.wandb_save_dir or (os.path.join(cfg.ckpt.save, "wandb") if cfg.ckpt.save else None)
    if save_dir is None:
        raise ConfigError("--wandb-project needs --wandb-save-dir DIR or --save DIR (W&B files go there)")
    os.makedirs(save_dir, exist_ok=True)
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity, dir=save_dir,
                      mode=mode, config=cfg.to_dict())


class Reporter:
    """The TensorBoard/W&B scalars of each step and the log line of each window (one per Trainer)."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.t, self.lg = trainer, cfg.log
        self.timers = Timers(self.lg.timing_log_level, trainer.device)
        self.writes = bool(self.lg.tensorboard_dir or self.lg.wandb_project)  # the same on every rank
        self._norms: tuple = (None, None, None)  # (iteration, params norm, num zeros)
        self.routers = moe.routers(trainer.models)  # the MoE losses' sources (none in a dense model), found once
        self.mtp_blocks = mtp.blocks(trainer.models)  # the "mtp_k loss" sources (--mtp-num-layers)
        self.pending: list = []  # (iteration, consumed samples, scalars) of steps not written yet (flush)
        self.extras: dict = {}  # the loss functions' other reports ([sum, count]; BERT's "sop loss") this window
        if trainer.log.enabled and not self.writes and (self.lg.log_timers_to_tensorboard or
                                                        self.lg.log_memory_to_tensorboard or
                                                        self.lg.log_validation_ppl_to_tensorboard or
                                                        self.lg.moe_per_layer_logging):
            trainer.log.print(" WARNING: --log-*-to-tensorboard flags and --moe-per-layer-logging write nothing "
                              "without --tensorboard-dir (or --wandb-project)")

    def norms(self) -> tuple[Optional[float], Optional[int]]:
        """(params norm, zeros in the gradients) of this iteration, as the flags ask; every rank calls it."""
        t = self.t
        if self._norms[0] != t.iteration:
            pn = t.optimizer.params_norm() if self.lg.log_params_norm else None
            nz = t.optimizer.num_zeros_in_grad() if self.lg.log_num_zeros_in_grad else None
            self._norms = (t.iteration, pn, nz)
        return self._norms[1], self._norms[2]

    def after_step(self, report: torch.Tensor, grad_norm, seconds: float, collector=None) -> None:
        """After each step: --train-sync-interval's wait for the GPU, --manual-gc's collection,
        --empty-unused-memory-level, and the TensorBoard/W&B scalars of the step (every
        --tensorboard-log-interval steps)."""
        t, lg, sync = self.t, self.lg, self.t.cfg.train.train_sync_interval
        if sync and t.iteration % sync == 0 and t.device.type == "cuda":  # the host at most N steps ahead
            torch.cuda.synchronize(t.device)
        if collector is not None:
            collector.after_step(t.iteration)
        empty_unused_memory(t.cfg.train.empty_unused_memory_level, 1, t.device)
        if not self.writes or t.iteration % lg.tensorboard_log_interval != 0:
            return
        params_norm, zeros = self.norms()
        values = {"learning-rate": t.scheduler.lr, "batch-size": t.current_global_batch,
                  "lm loss": report[0] / report[1].clamp(min=1.0), "grad-norm": grad_norm,
                  "num-zeros": zeros, "params-norm": params_norm}
        if not lg.no_log_loss_scale_to_tensorboard:
            values["loss-scale"] = t.optimizer.loss_scale
        if lg.log_world_size_to_tensorboard:
            values["world-size"] = t.dims.world_size
        if lg.log_memory_to_tensorboard:
            values.update(memory_scalars(t.device))
        if lg.log_timers_to_tensorboard:
            values.update(self.timers.take(lg.tensorboard_log_interval))
            values["iteration-time"] = seconds
            if lg.log_throughput:
                values["throughput"] = t.flops_per_iter * t.current_global_batch / t.cfg.train.global_batch_size \
                    / seconds / t.dims.world_size / 1e12
        # Device values (the loss, the grad norm, a dynamic loss scale) are read back together at the next
        # log line or the end of training: one host synchronisation per window, not one per step.
        self.pending.append((t.iteration, t.consumed_samples,
                             {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}))

    def flush(self) -> None:
        """Write the scalars of the steps since the last flush (their device values in one read-back)."""
        if not self.pending:
            return
        device = [v for _, _, values in self.pending for v in values.values() if isinstance(v, torch.Tensor)]
        host = iter(torch.stack([v.float().reshape(()).to(self.t.device) for v in device]).tolist() if device else [])
        for iteration, samples_at, values in self.pending:
            values = {k: next(host) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
            samples = {k: v for k, v in values.items() if k in VS_SAMPLES or k == "lm loss"}
            self.t.log.scalars(iteration, values, samples_at, samples)
        self.pending.clear()

    def note_extras(self, reports: list[dict]) -> None:
        """Add the micro-batches' reports other than ``lm loss`` (each [sum, count]) to the window's."""
        for r in reports:
            for name, value in r.items():
                if name != "lm loss":
                    self.extras[name] = self.extras.get(name, 0) + value.detach().to(self.t.device)

    def take_extras(self) -> dict:
        """The window's other losses, each its sum over the data-parallel ranks / their count (Megatron's
        average over the data-parallel group); the ranks of a pipeline stage hold the same names."""
        out = {}
        for name, value in sorted(self.extras.items()):
            value = self.t._reduce_dp(value.clone())
            out[name] = (value[0] / value[1].clamp(min=1)).item()
        self.extras.clear()
        return out

    def validation(self, loss: float) -> None:
        t = self.t
        t.log.valid(t.iteration, loss, t.consumed_samples, self.lg.log_validation_ppl_to_tensorboard)

    def log_line(self, acc: torch.Tensor, iters: int, seconds: float, grad_norm: float) -> None:
        """Megatron's log line of the window of ``iters`` iterations (every rank calls it)."""
        t, tr = self.t, self.t.cfg.train
        self.flush()
        sums = acc.tolist()
        loss = sums[0] / max(sums[1], 1.0)
        if loss != loss:
            t.nan_iters += iters
        per_iter = seconds / max(iters, 1)
        gbs = t.current_global_batch  # of the last step (follows --rampup-batch-size)
        flops = t.flops_per_iter * gbs / tr.global_batch_size  # of this step's batch (--rampup-batch-size)
        tflops = flops / per_iter / t.dims.world_size / 1e12
        tokens_s = gbs * t.cfg.model.seq_length / per_iter / t.dims.world_size
        mfu = 100.0 * tflops / t.peak if t.peak else None
        peak_gb = peak_memory_gb(t.device)
        params_norm, zeros = self.norms()  # collectives: every rank
        m = t.cfg.model
        layers = m.num_layers + (m.mtp_num_layers or 0)  # the MTP layers' routers are numbered after the decoder's
        moe_losses, moe_layers = (moe.take_metrics(self.routers, t.device, dist.is_initialized(), layers)
                                  if m.num_experts is not None else ({}, {}))  # every rank joins
        mtp_losses = (mtp.take_metrics(self.mtp_blocks, m.mtp_num_layers, t.device, dist.is_initialized())
                      if m.mtp_num_layers else {})  # Megatron's "mtp_k loss" (every rank joins)
        extra = dict(self.take_extras(), **moe_losses, **mtp_losses,
                     **({"num zeros": float(zeros)} if zeros is not None else {}))
        energy = t.energy.lap(iters, seconds, t.dims.world_size) if t.energy is not None else None  # (every rank)
        t.log.print(format_train_line(t.iteration, tr.train_iters, t.consumed_samples, per_iter * 1000.0, tflops,
                                      t.scheduler.lr, gbs, loss, t.optimizer.loss_scale, grad_norm, t.skipped,
                                      t.nan_iters, tokens_s, mfu, peak_gb, params_norm, extra, energy))
        t.log.train(t.iteration, loss)
        scalars = dict(moe_losses, **mtp_losses, **(moe_layers if self.lg.moe_per_layer_logging else {}))
        if energy is not None:  # Megatron's tags
            scalars.update({"iter-energy/gpu": energy[0], "power/gpu": energy[1]})
        if self.lg.log_throughput:  # paratron's own throughput tags (the log line always has them)
            scalars.update({"throughput TFLOP/s/GPU": tflops, "tokens per second per GPU": tokens_s, "MFU %": mfu})
        if self.writes:
            t.log.scalars(t.iteration, scalars, t.consumed_samples, moe_losses)
        t.log.advance(0, loss)
        for line in t.straggler.report(iters, flops):  # every rank calls it
            print(line, flush=True)
        if t.memory_history:  # --record-memory-history: this rank's snapshot so far
            dump_memory_snapshot(self.lg, t.dims.rank)
        every = self.lg.log_memory_interval
        if every and t.iteration % every == 0 and t.dims.dp_rank == 0:  # each model-parallel rank, as Megatron
            print(memory_line(t.device, t.dims.rank, f"after {t.iteration} iterations"), flush=True)
