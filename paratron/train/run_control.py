"""The run control of the Trainer (a mixin of paratron.train.loop.Trainer): skipped updates counted
without a host synchronisation, --iterations-to-skip, and the exit conditions (--train-iters,
--exit-interval, --exit-duration-in-mins, --exit-signal-handler) with the line saying why a run stops."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class RunControl:
    def _count_skip(self, ok) -> None:
        """A skipped update (non-finite gradients): counted now when ``ok`` is a host bool, at the next
        log line when it is a device flag (no host synchronisation in the step)."""
        if isinstance(ok, torch.Tensor):
            skips = (~ok).int()
            self._pending_skips = skips if self._pending_skips is None else self._pending_skips + skips
        elif not ok:
            self.skipped += 1

    def _fold_pending_skips(self) -> None:
        if self._pending_skips is not None:
            self.skipped += int(self._pending_skips.item())
            self._pending_skips = None

    def _skip_step(self) -> None:
        """--iterations-to-skip (Megatron's): the step's micro-batches are read and dropped; the iteration
        and the consumed samples advance, nothing else does (no update, no learning-rate step, no log
        line, no save or evaluation at that iteration)."""
        gbs = self.microbatches.global_batch(self.consumed_samples)
        if self.train_iter is not None:
            for _ in range(self.num_microbatches):
                next(self.train_iter)
        self.iteration += 1
        self.consumed_samples += gbs
        self.log.advance(1)
        self.log.print(f" skipped iteration {self.iteration} (--iterations-to-skip): its {gbs} samples read, "
                       "not trained on")

    def _should_exit(self, start: float) -> bool:
        tr = self.cfg.train
        stop = self.iteration >= tr.train_iters  # the iteration-based conditions are the same on every rank
        stop |= bool(tr.exit_interval and self.iteration % tr.exit_interval == 0)
        if stop or not (tr.exit_duration_in_mins or tr.exit_signal_handler):
            return stop
        # A clock or a signal can differ between ranks: every rank must agree (one all-reduce).
        stop |= bool(tr.exit_duration_in_mins and (time.time() - start) / 60.0 > tr.exit_duration_in_mins)
        stop |= self.stop_signal.received
        if dist.is_initialized():
            flag = torch.tensor([int(stop)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _log_exit(self, start: float) -> None:
        """The line saying why a run stops early (none when --train-iters is reached)."""
        tr, minutes = self.cfg.train, (time.time() - start) / 60.0
        if self.iteration >= tr.train_iters:
            return
        if tr.exit_interval and self.iteration % tr.exit_interval == 0:
            why = f"--exit-interval {tr.exit_interval}"
        elif tr.exit_duration_in_mins and minutes > tr.exit_duration_in_mins:
            why = f"--exit-duration-in-mins {tr.exit_duration_in_mins:g} ({minutes:.2f} min since start-up)"
        elif self.stop_signal.received:
            why = f"{tr.exit_signal} (--exit-signal-handler)"
        else:
            why = "another rank's clock or signal (--exit-duration-in-mins / --exit-signal-handler)"
        self.exit_reason = why
        self.log.print(f" exiting after {self.iteration} iterations: {why}")
