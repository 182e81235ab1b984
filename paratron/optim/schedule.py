"""Learning-rate schedule as Megatron's OptimizerParamScheduler: counted in samples, linear warm-up
then constant | linear | cosine | inverse-square-root | WSD decay to ``--min-lr``."""
from __future__ import annotations

import math
from typing import Optional

from ..config import Config, ConfigError
from ..model import mup


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int, decay_style: str,
                 init_lr: float = 0.0, wsd_decay_steps: int = 0, wsd_decay_style: str = "exponential",
                 decoupled_max_lr: Optional[float] = None, decoupled_min_lr: Optional[float] = None,
                 hidden_scale: float = 1.0):
        """``decoupled_max_lr``/``decoupled_min_lr``: the peak and minimum of --decoupled-lr (the word
        embedding and output layer follow the same schedule between them); None: no decoupled LR.
        ``hidden_scale``: muP's 1/m, the hidden weight matrices' peak and minimum LR times it."""
        self.max_lr, self.min_lr, self.init_lr, self.hidden_scale = max_lr, min_lr, init_lr, hidden_scale
        self.decoupled_max_lr, self.decoupled_min_lr = decoupled_max_lr, decoupled_min_lr
        self.warmup_steps, self.decay_steps, self.style = warmup_steps, max(decay_steps, 1), decay_style
        self.wsd_decay_steps, self.wsd_style = wsd_decay_steps, wsd_decay_style
        self.num_steps = 0

    def lr_at(self, n: int, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The LR after ``n`` samples; ``max_lr``/``min_lr``: another peak and minimum on the same schedule
        (a parameter group's, as Megatron's param groups), default the main ones."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * n / self.warmup_steps
        if self.style == "constant":
            return max_lr
        if n > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warm) / math.sqrt(max(n, 1)))
        ratio = (n - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = (n - anneal_start) / max(self.wsd_decay_steps, 1)
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * (0.5 ** r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.wsd_style]
        return min_lr + coeff * (max_lr - min_lr)

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    @property
    def decoupled_lr(self) -> Optional[float]:
        """The LR of the word embedding and output layer now (--decoupled-lr), None without one."""
        if self.decoupled_max_lr is None:
            return None
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        return self.lr_at(self.num_steps, self.decoupled_max_lr, low)

    @property
    def hidden_lr(self) -> Optional[float]:
        """The LR of the hidden weight matrices now under muP (peak and minimum / m), None without it."""
        if self.hidden_scale == 1.0:
            return None
        return self.lr_at(self.num_steps, self.max_lr * self.hidden_scale, self.min_lr * self.hidden_scale)

    def lrs(self) -> tuple:
        """(LR, decoupled LR, hidden LR) now: what ``set_lr`` of the optimizers takes."""
        return self.lr, self.decoupled_lr, self.hidden_lr

    def step(self, increment: int) -> float:
        self.num_steps += increment
        return self.lr

    def state_dict(self) -> dict:
        out = {"num_steps": self.num_steps}
        out.update({key: getattr(self, attr) for key, (attr, _) in SCHEDULE_KEYS.items()})
        return out

    def load_state_dict(self, sd: dict) -> None:
        """The position in the schedule only (``resume`` also reconciles the schedule itself)."""
        self.num_steps = int(sd["num_steps"])

    def resume(self, sd: dict, op) -> None:
        """Continue a checkpoint's schedule as Megatron does. The position (samples seen) always
        comes from ``sd``. The schedule's values (peak and minimum LR, warm-up, decay length and
        style, ...) must match the command line's, unless ``op`` (the optim section) says
        ``override_opt_param_scheduler`` (the command line's win) or
        ``use_checkpoint_opt_param_scheduler`` (the checkpoint's win). A mismatch without either
        is a ConfigError naming every differing value and both flags."""
        self.load_state_dict(sd)
        if op.override_opt_param_scheduler:
            return
        saved = {key: sd[key] for key in SCHEDULE_KEYS if key in sd}  # older checkpoints saved fewer keys
        if op.use_checkpoint_opt_param_scheduler:
            for key, value in saved.items():
                setattr(self, SCHEDULE_KEYS[key][0], value)
            return
        diffs = [f"{what} {getattr(self, attr)!r} here, {saved[key]!r} in the checkpoint"
                 for key, (attr, what) in SCHEDULE_KEYS.items() if key in saved and getattr(self, attr) != saved[key]]
        if diffs:
            raise ConfigError("the LR schedule differs from the checkpoint's: " + "; ".join(diffs)
                              + "; pass --override-opt_param-scheduler to use this command line's schedule or "
                              "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


# state_dict key -> (LRScheduler attribute, how the error names it). Warm-up and decay are in samples.
SCHEDULE_KEYS = {
    "max_lr": ("max_lr", "--lr"),
    "min_lr": ("min_lr", "--min-lr"),
    "init_lr": ("init_lr", "--lr-warmup-init"),
    "warmup_steps": ("warmup_steps", "warm-up samples (--lr-warmup-iters/-samples/-fraction)"),
    "decay_steps": ("decay_steps", "decay samples (--lr-decay-iters/-samples, default --train-iters/-samples)"),
    "decay_style": ("style", "--lr-decay-style"),
    "wsd_decay_steps": ("wsd_decay_steps", "WSD decay samples (--lr-wsd-decay-iters/-samples)"),
    "wsd_decay_style": ("wsd_style", "--lr-wsd-decay-style"),
    "decoupled_max_lr": ("decoupled_max_lr", "--decoupled-lr"),
    "decoupled_min_lr": ("decoupled_min_lr", "--decoupled-min-lr"),
    "hidden_scale": ("hidden_scale", "the hidden matrices' LR factor (--use-mup: --mup-base-hidden-size / --hidden-size)"),
}


def build_scheduler(cfg: Config, total_samples: int) -> LRScheduler:
    """Steps are samples: iterations x global batch, as Megatron counts them."""
    op, gbs = cfg.optim, cfg.train.global_batch_size
    if op.lr_decay_samples is not None:
        decay = op.lr_decay_samples
    elif op.lr_decay_iters is not None:
        decay = op.lr_decay_iters * gbs
    else:
        decay = total_samples
    if op.lr_warmup_fraction is not None:
        warmup = int(op.lr_warmup_fraction * decay)
    else:
        warmup = op.lr_warmup_samples or op.lr_warmup_iters * gbs
    if op.lr_wsd_decay_samples is not None:
        wsd = op.lr_wsd_decay_samples
    else:
        wsd = (op.lr_wsd_decay_iters or 0) * gbs
    return LRScheduler(op.lr, op.min_lr, warmup, decay, op.lr_decay_style, op.lr_warmup_init, wsd, op.lr_wsd_decay_style,
                       op.decoupled_lr, op.decoupled_min_lr, 1.0 / mup.width_mult(cfg.model))
