"""What a run reports: Megatron's log line, a progress bar on a terminal, TensorBoard event files,
and a PNG plot of the loss curves at the end. Only the logging rank writes."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def format_train_line(it: int, total: int, consumed: int, ms_per_iter: float, tflops: float, lr: float, gbs: int,
                      loss: float, loss_scale: float, grad_norm: Optional[float], skipped: int, nan: int,
                      tokens_per_s: float, mfu: Optional[float], peak_gb: Optional[float],
                      params_norm: Optional[float] = None, extra: Optional[dict] = None,
                      energy: Optional[tuple] = None) -> str:
    """``energy``: (joules per iteration, watts) per GPU, --log-energy's."""
    parts = [
        f" [{stamp()}] iteration {it:8d}/{total:8d}",
        f"consumed samples: {consumed:12d}",
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}" if tflops >= 1 else f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f}",
    ]
    if energy is not None:
        parts += [f"energy per GPU (J/iter/GPU): {energy[0]:.1f}", f"power per GPU (W/GPU): {energy[1]:.1f}"]
    parts += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {gbs:5d}",
        f"lm loss: {loss:.6E}",
        f"loss scale: {loss_scale:.1f}",
    ]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if params_norm is not None:  # --log-params-norm
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [f"{k}: {v:.6E}" for k, v in (extra or {}).items()]  # MoE: load_balancing_loss, z_loss
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nan:3d}",
              f"tokens per second per GPU: {tokens_per_s:.0f}",
              f"MFU: {mfu:.1f} %" if mfu is not None else "MFU: n/a"]
    if peak_gb is not None:
        parts.append(f"peak memory (GB): {peak_gb:.2f}")
    return " | ".join(parts) + " |"


def format_valid_line(it: int | str, loss: float, label: str = "validation") -> str:
    """Megatron's validation line; ``it`` an iteration, or a phrase such as "the end of training for test data"."""
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else loss  # (min(20, nan) would be 20)
    where = f"at iteration {it}" if isinstance(it, int) else f"at {it}"
    return f" {label} loss {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "


class RunLogger:
    def __init__(self, enabled: bool, total_iters: int, tensorboard_dir: Optional[str], start_iter: int = 0,
                 queue_size: int = 1000, wandb_run=None):
        self.enabled = enabled
        self.train_curve: list[tuple[int, float]] = []
        self.valid_curve: list[tuple[int, float]] = []
        self.writer = None
        self.wandb = wandb_run if enabled else None
        self.bar = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_iters, initial=start_iter, unit="it", dynamic_ncols=True, leave=True)

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, n: int = 1, loss: Optional[float] = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")

    def scalars(self, it: int, values: dict, samples: Optional[int] = None, vs_samples: Optional[dict] = None) -> None:
        """TensorBoard and W&B scalars at step ``it``; ``vs_samples`` also as ``<tag> vs samples`` at
        step ``samples`` (Megatron's second axis). None and non-finite values are left out."""
        values = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, it)
            for k, v in (vs_samples or {}).items():
                if v is not None and math.isfinite(v):
                    self.writer.add_scalar(f"{k} vs samples", v, samples)
        if self.wandb is not None and values:
            self.wandb.log(values, step=it)

    def train(self, it: int, loss: float) -> None:
        if self.enabled:
            self.train_curve.append((it, loss))

    def valid(self, it: int, loss: float, samples: Optional[int] = None, ppl: bool = True) -> None:
        """A validation loss; TensorBoard gets ``lm loss validation`` (+ ``ppl`` when asked)."""
        if self.enabled:
            self.valid_curve.append((it, loss))
            values = {"lm loss validation": loss}
            if ppl:
                values["lm loss validation ppl"] = math.exp(min(20.0, loss))
            self.scalars(it, values, samples if samples is not None else it, values)

    def plot(self, path: str | Path) -> Optional[Path]:
        if not self.enabled or not self.train_curve:
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        ax.plot(*zip(*self.train_curve), label="train", lw=1.2)
        if self.valid_curve:
            ax.plot(*zip(*self.valid_curve), "o-", label="validation", lw=1.5)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
