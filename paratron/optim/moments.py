"""Adam's moments held in a lower precision: Megatron's ``--use-precision-aware-optimizer`` with
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``.

Each moment is computed in fp32 at every step and held in memory between steps as:

    fp32   as torch's AdamW holds it (4 bytes an element)
    bf16   rounded to bf16, to nearest (2 bytes)
    fp16   scaled per tensor (2 bytes): held = value / scale with scale = absmax / (fp16 max / 2)
    fp8    e4m3, scaled per tensor (1 byte): scale = absmax / 448

which is how Transformer Engine's FusedAdam (the optimizer Megatron's flag selects) holds them. A tensor is
one master: a parameter (plain optimizer) or this rank's piece of one (distributed optimizer), so a scale
belongs to a piece. The scale is an fp32 scalar in the state beside the moment (``exp_avg_scale``).

:class:`LowPrecisionAdamW` keeps torch's AdamW's groups and state layout (``adam.state[master]["exp_avg"]``,
a ``step`` counter) and steps each master with torch's single-tensor AdamW formula in fp32: the moments are
read into fp32 temporaries, updated, and stored back, so the working memory is two fp32 copies of the
largest master. Where the optimizer's on-device step runs (CUDA with Triton, bf16/fp16 parameters), fp32
and bf16 moments are stepped instead by the AdamW kernel of paratron/kernels/fused_adamw.py, which reads
and writes them in their dtype; fp16 and fp8 moments always take this class's step (one host
synchronisation per step, as the optimizer's step with a dynamic loss scale).

Checkpoints hold fp32 and bf16 moments as they are and fp16 / fp8 ones as fp32 values (a transient fp32
copy per master while saving or loading), under the usual names: a checkpoint loads into a run with any
moment dtypes.
"""
from __future__ import annotations

import torch

STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
RANGE = {torch.float16: torch.finfo(torch.float16).max / 2, torch.float8_e4m3fn: 448.0}  # absmax maps here
MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_dtypes(op) -> dict:
    """{moment: storage dtype} of a resolved optim section."""
    return {"exp_avg": STORAGE[op.exp_avg_dtype], "exp_avg_sq": STORAGE[op.exp_avg_sq_dtype]}


def lowered(dtypes: dict) -> bool:
    return any(d != torch.float32 for d in dtypes.values())


def kernel_takes(dtypes: dict) -> bool:
    """Whether the AdamW kernel (kernels/fused_adamw.py) can step moments of these dtypes (no scale)."""
    return all(d in (torch.float32, torch.bfloat16) for d in dtypes.values())


class LowPrecisionAdamW(torch.optim.AdamW):
    """AdamW whose moments are held in ``dtypes`` ({"exp_avg": dtype, "exp_avg_sq": dtype}). The state is
    created here, for every master (zero moments, step 0): its ``step`` counters on the masters' devices
    when ``device_steps`` (the AdamW kernel reads them there), else on the host (read by this step without
    a synchronisation)."""

    def __init__(self, groups: list, lr: float, betas: tuple, eps: float, dtypes: dict, device_steps: bool = False):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, foreach=False)
        self.dtypes = dict(dtypes)
        self._views: list = []  # (master, moment, fp32 copy) of scaled moments handed to a checkpoint
        for group in self.param_groups:
            for m in group["params"]:
                state = self.state[m]
                state["step"] = torch.zeros((), dtype=torch.float32, device=m.device if device_steps else "cpu")
                for name, dtype in self.dtypes.items():
                    state[name] = torch.zeros(m.shape, dtype=dtype, device=m.device)
                    if dtype in RANGE:
                        state[name + "_scale"] = torch.ones((), dtype=torch.float32, device=m.device)

    # ---- one moment in fp32 ----------------------------------------------------------------------
    def unscaled(self, master: torch.Tensor, name: str) -> torch.Tensor:
        """The moment's values in fp32: the state tensor itself when it is fp32, else a new tensor."""
        state = self.state[master]
        held = state[name]
        if held.dtype == torch.float32:
            return held
        value = held.float()
        return value.mul_(state[name + "_scale"]) if held.dtype in RANGE else value

    @torch.no_grad()
    def store(self, master: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Hold fp32 ``value`` as the moment: rounded to its dtype, scaled first for fp16 / fp8. ``value`` may be
        overwritten."""
        state = self.state[master]
        held = state[name]
        if value is held:
            return
        if held.dtype in RANGE:  # absmax maps to the dtype's range; an all-zero moment keeps scale 0 and zeros
            scale = state[name + "_scale"]
            torch.div(value.abs().amax().float(), RANGE[held.dtype], out=scale)
            value.mul_(torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)))
        held.copy_(value)

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """torch's single-tensor AdamW over every master with a ``.grad``, in fp32, the moments read and stored
        in their dtypes."""
        if closure is not None:
            raise ValueError("LowPrecisionAdamW takes no closure")
        work = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        steps = [self.state[p]["step"] for _, p in work]
        if not steps:
            return None
        torch._foreach_add_(steps, 1.0)
        one_device = len({s.device for s in steps}) == 1
        counts = torch.stack(steps).tolist() if one_device else [float(s) for s in steps]  # (one read on a GPU)
        for (group, p), t in zip(work, counts):
            (beta1, beta2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
            grad, m, v = p.grad, self.unscaled(p, "exp_avg"), self.unscaled(p, "exp_avg_sq")
            p.mul_(1 - lr * wd)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1, bias_correction2 = 1 - beta1 ** t, 1 - beta2 ** t
            denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias_correction1)
            self.store(p, "exp_avg", m)
            self.store(p, "exp_avg_sq", v)
        return None

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint_view(self, master: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor a checkpoint saves the moment from and loads it into: the state tensor itself (fp32, bf16),
        or an fp32 copy of a scaled one, kept until :meth:`settle_views`."""
        held = self.state[master][name]
        if held.dtype not in RANGE:
            return held
        view = self.unscaled(master, name)
        self._views.append((master, name, view))
        return view

    def settle_views(self, loaded: bool) -> None:
        """After a checkpoint was saved (``loaded`` False: the copies are dropped) or loaded (True: the loaded
        fp32 values are stored back, scaled)."""
        views, self._views = self._views, []
        if loaded:
            for master, name, view in views:
                self.store(master, name, view)


def settle_views(adam: torch.optim.Optimizer, loaded: bool) -> None:
    if isinstance(adam, LowPrecisionAdamW):
        adam.settle_views(loaded)


def checkpoint_view(adam: torch.optim.Optimizer, master: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor of ``master``'s moment ``name`` a checkpoint saves and loads (see LowPrecisionAdamW)."""
    if isinstance(adam, LowPrecisionAdamW):
        return adam.checkpoint_view(master, name)
    return adam.state[master][name]

