"""What keeps a run honest when something goes wrong: the NaN/Inf and spiky-loss checks of every
step (``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss``) and the preemption signal
(``--exit-signal-handler``). docs/reliability.md says what each one guarantees."""
from __future__ import annotations

import math
import signal
from typing import Callable, Optional

import torch

from ..errors import UserError


class NumericalError(UserError):
    """The loss or the gradient norm stopped being finite (or spiked): the run stops, saving nothing."""


class StepGuard:
    """Checks each step's loss and gradient norm one step late: the values are copied to the host
    without waiting (pinned memory and an event on GPUs) and read when the next step has been
    queued, so the host never stalls the GPU, and a bad step stops the run within two iterations.
    :meth:`check` reads the pending values at once (before a save, at the end of training).

    NaN/Inf: the loss on every rank that has it (the last pipeline stage) and, except with --fp16
    (whose loss scaler skips steps with overflowing gradients), the gradient norm on every rank.
    Spikes: a loss above ``factor`` x the largest (non-spike) loss seen so far in this run is reported through
    ``report`` and, with ``exit_on_spike``, stops the run."""

    def __init__(self, nan: bool, grad: bool, spiky: bool, factor: float, exit_on_spike: bool, rank: int,
                 report: Callable[[str], None]):
        self.nan, self.grad, self.spiky = nan, nan and grad, spiky
        self.factor, self.exit_on_spike, self.rank, self.report = factor, exit_on_spike, rank, report
        self.max_loss: Optional[float] = None
        self.spikes = 0
        self._pending: Optional[tuple] = None

    @classmethod
    def from_config(cls, cfg, rank: int, report: Callable[[str], None]) -> "StepGuard":
        tr = cfg.train
        return cls(tr.check_for_nan_in_loss_and_grad, not tr.fp16, tr.check_for_spiky_loss, tr.spiky_loss_factor,
                   tr.exit_on_spiky_loss, rank, report)

    @property
    def active(self) -> bool:
        return self.nan or self.spiky

    def record(self, iteration: int, report: torch.Tensor, grad_norm) -> None:
        """The step that ended at ``iteration``: ``report`` = [loss sum, tokens] (zeros off the last
        stage), ``grad_norm`` a float or a 0-d tensor. Checks the previous step first."""
        if not self.active:
            return
        self.check()
        norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=report.device).reshape(1)
        values = torch.cat([report.detach().float().reshape(2), norm])
        event = None
        if values.is_cuda:
            host = torch.empty(3, dtype=torch.float32, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._pending = (iteration, values, event)

    def check(self) -> None:
        """Read the pending step's values; raise :class:`NumericalError` on a NaN/Inf (or a spike
        with ``exit_on_spike``)."""
        if self._pending is None:
            return
        iteration, values, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        total, tokens, norm = values.tolist()
        loss = total / tokens if tokens > 0 else total
        where = f"at iteration {iteration} on rank {self.rank}"
        if self.nan and not math.isfinite(loss):
            raise NumericalError(f"the loss is {loss} {where}: training stops and saves nothing, so the last checkpoint "
                                 "is the last good state; lower --lr (or check the data) and resume with --load "
                                 "(--no-check-for-nan-in-loss-and-grad trains on regardless)")
        if self.grad and not math.isfinite(norm):
            raise NumericalError(f"the gradient norm is {norm} {where}: training stops and saves nothing, so the last "
                                 "checkpoint is the last good state; lower --lr and resume with --load "
                                 "(--no-check-for-nan-in-loss-and-grad skips such steps instead)")
        if self.spiky and tokens > 0 and math.isfinite(loss):
            self._check_spike(loss, where)

    def _check_spike(self, loss: float, where: str) -> None:
        if self.max_loss is not None and loss > self.factor * self.max_loss:
            self.spikes += 1
            message = (f"spiky loss {where}: {loss:.6E} is more than --spiky-loss-factor {self.factor:g} x the "
                       f"largest loss so far ({self.max_loss:.6E})")
            if self.exit_on_spike:
                raise NumericalError(message + "; training stops and saves nothing (--exit-on-spiky-loss); resume "
                                               "from the last checkpoint with --load")
            self.report(f" WARNING: {message}")
            return  # a spike does not raise the bar for the next one
        self.max_loss = loss if self.max_loss is None else max(self.max_loss, loss)


class StopSignal:
    """``--exit-signal-handler``: the ``--exit-signal`` (SIGTERM by default: what SLURM and Kubernetes
    send before killing a job) only sets :attr:`received`; the loop finishes its step, the ranks agree
    to stop, save and exit 0. A second signal (during the save) changes nothing; the save is atomic anyway."""

    def __init__(self, enabled: bool, name: str = "SIGTERM"):
        self.received = False
        if enabled:
            signal.signal(signal.Signals[name], self._handle)

    def _handle(self, *_) -> None:
        self.received = True


def kill_workers_at_exit() -> None:
    """DataLoader workers that ignore SIGTERM outlive ``Process.terminate()``, which is how
    multiprocessing stops daemon children at interpreter exit (then it joins them: a hang, after an
    error such as a dead peer). Registered after multiprocessing's own exit handler, this one runs
    first and kills the remaining children for good (they hold nothing worth keeping)."""
    import atexit
    import multiprocessing

    def kill_children() -> None:
        children = multiprocessing.active_children()
        if children:  # torch's SIGCHLD handler would report the killed workers as a failure at exit
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in children:
            child.kill()
    atexit.register(kill_children)


def _feeder_error(error: BaseException, _obj) -> None:
    """A DataLoader worker's queue feeder thread failed: silent when the main process has gone (killed by
    SIGTERM without --exit-signal-handler, or by torchrun): its pipe is closed and the worker exits at its
    next check; a traceback of that ``ConnectionResetError`` would only hide the real cause."""
    if isinstance(error, (BrokenPipeError, ConnectionResetError, EOFError)):
        return
    import traceback
    traceback.print_exc()


def data_worker_init(signal_name: Optional[str], worker_id: int) -> None:
    """Every DataLoader worker's ``worker_init_fn``: quiet when the main process is gone (above), and
    ignoring ``signal_name`` when given (--exit-signal-handler: :func:`ignore_signal`)."""
    import multiprocessing.queues
    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(_feeder_error)  # (this worker process only)
    if signal_name:
        ignore_signal(signal_name, worker_id)


def ignore_signal(name: str, _worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` (Megatron's --exit-signal-handler-for-dataloader; bound to the
    ``--exit-signal`` name with functools.partial): the workers live in the job's process group and get
    its signal too; they must outlive it until the main process has saved and shuts them down."""
    signal.signal(signal.Signals[name], signal.SIG_IGN)
