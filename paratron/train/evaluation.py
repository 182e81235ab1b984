"""The evaluation side of the Trainer (a mixin of paratron.train.loop.Trainer): the validation loss over
--eval-iters steps, when evaluations are due (--eval-interval, --start-eval-at-iter), the evaluations at
the end of training and --skip-train's evaluation of a loaded model."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .logger import format_valid_line
from .runtime import GarbageCollection, empty_unused_memory
from .step import sum_reports

LONG_EVALUATION_S = 10.0  # an evaluation expected to take longer is announced first


class Evaluation:
    @torch.no_grad()
    def evaluate(self, data_iterator=None) -> float:
        """The loss over --eval-iters steps of the validation data (or of ``data_iterator``)."""
        data_iterator = data_iterator or self.valid_iter
        for m in self.models:
            m.eval()
        total = torch.zeros(2, device=self.device)
        tr, n = self.cfg.train, self.microbatches.eval_microbatches(self.consumed_samples)
        start = time.monotonic()
        for step in range(tr.eval_iters):
            if step == 1:
                self._announce_long_evaluation(time.monotonic() - start)
            reports = self.forward_backward(forward_step_func=self.forward_step, data_iterator=data_iterator,
                                            model=self.models, num_microbatches=n,
                                            seq_length=self.cfg.model.seq_length, micro_batch_size=tr.micro_batch_size,
                                            layout=self.layout, forward_only=True)
            total += sum_reports(reports, self.device)
        for m in self.models:
            m.train()
        total = self._reduce_dp(total)
        return (total[0] / total[1].clamp(min=1)).item()

    def _announce_long_evaluation(self, first_step_s: float) -> None:
        """One line before an evaluation that will take a while (over 10 s at the first step's pace), so
        that a quiet console is not taken for a hang (Megatron's default --eval-iters is 100)."""
        eval_iters = self.cfg.train.eval_iters
        expected = first_step_s * eval_iters
        if expected > LONG_EVALUATION_S:
            self.log.print(f" evaluating {eval_iters} steps (--eval-iters {eval_iters}), about {expected:.0f} s ...")

    def _eval_due(self) -> bool:
        """An evaluation at this iteration: every --eval-interval, from --start-eval-at-iter on."""
        tr = self.cfg.train
        return self.iteration % tr.eval_interval == 0 and self.iteration >= (tr.start_eval_at_iter or 0)

    def _evaluate_only(self) -> dict:
        """--skip-train (Megatron's): the validation and test losses at the loaded iteration; no training."""
        valid_loss = self._validate() if self.valid_iter is not None else None
        if self.test_iter is not None:
            self.log.print(format_valid_line("the loaded model for test data", self.evaluate(self.test_iter)))
        return {"iteration": self.iteration, "exit_reason": "--skip-train", "valid_loss": valid_loss,
                "train_curve": [], "valid_curve": self.log.valid_curve}

    def _final_evaluations(self, valid_loss: Optional[float]) -> Optional[float]:
        """After training: the validation loss unless it was just measured, and (as Megatron) the
        test split once, when training ran to its end. Returns the last validation loss."""
        tr = self.cfg.train
        if self.valid_iter is not None and tr.eval_iters > 0 and self.iteration % tr.eval_interval:
            valid_loss = self._validate()
        if self.test_iter is not None and self.iteration >= tr.train_iters:
            self.log.print(format_valid_line("the end of training for test data", self.evaluate(self.test_iter)))
        return valid_loss

    def _validate(self, collector: Optional[GarbageCollection] = None) -> float:
        if collector is not None:
            collector.around_eval()
        loss = self.evaluate()
        self.log.print(format_valid_line(self.iteration, loss))
        self.report.validation(loss)
        empty_unused_memory(self.cfg.train.empty_unused_memory_level, 2, self.device)
        if collector is not None:
            collector.around_eval()
        return loss
