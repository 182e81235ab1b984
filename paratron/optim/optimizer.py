"""AdamW with fp32 master weights, loss scaling for fp16, and gradient clipping by the global norm
over every parallel group (each replicated parameter counted once)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config, ConfigError, KernelConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from ..parallel.dims import ParallelDims
from ..parallel.sharding import REDUCTION_LAYOUTS, norm_groups, spec_of
from ..model import mup
from ..kernels import fused_adamw
from . import moments, offload
from .groups import Role, role_of


def _picked(grads: list[torch.Tensor], own: list[bool], which: bool) -> list[torch.Tensor]:
    """``grads`` with the entries whose ``own`` flag is not ``which`` emptied (same positions: the norm
    sums keep their alignment with the masters)."""
    return [g if o == which else g[:0] for g, o in zip(grads, own)]


class ConstantScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])


class DynamicScaler(ConstantScaler):
    """Megatron's dynamic loss scaler: back off after ``hysteresis`` overflows, grow after
    ``window`` clean steps."""

    def __init__(self, initial: float, min_scale: float, window: int, hysteresis: int,
                 growth: float = 2.0, backoff: float = 0.5):
        super().__init__(initial)
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self.growth, self.backoff = growth, backoff
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd.get("growth_tracker", 0))
        self.hysteresis_tracker = int(sd.get("hysteresis_tracker", self.hysteresis))


def norm_set_candidates() -> list[tuple]:
    """Every set of groups a gradient buffer may sum its squared norm over, in a fixed order."""
    return [t for g, lay in REDUCTION_LAYOUTS.items() for t in ((g, lay["norm_group"]), (lay["norm_group"],))]


def agree_on_norm_sets(mine: set, dims: ParallelDims, device) -> list[tuple]:
    """The norm-group sets used anywhere in the model, in a fixed order, the same on every rank (a
    pipeline stage without expert layers still joins the experts' norm reduction). One collective,
    once, at set-up."""
    candidates = norm_set_candidates()
    unknown = mine - set(candidates)
    if unknown:
        raise ValueError(f"gradient buffers with unknown norm groups {sorted(unknown)}")
    flags = torch.tensor([float(c in mine) for c in candidates], device=device)
    if dims.world_size > 1 and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [c for c, f in zip(candidates, flags.tolist()) if f]


class MixedPrecisionAdam:
    """The step shared by the plain and the distributed optimizer: AdamW on fp32 master tensors
    (``self.masters``) whose fp32 gradients come from the data-parallel gradient buffer.

    step(): unscale (fp16), global grad norm (one host sync), skip on inf/nan, clip, AdamW (and Muon
    for the hidden matrices with --optimizer muon, paratron/optim/muon.py), then publish the masters
    to the model parameters. Subclasses say where the gradients come from, which
    groups the squared norm is summed over, and how the parameters are updated."""

    def _setup(self, masters: list[torch.Tensor], roles: list[Role], norm_sets: list[tuple], counted: list[bool],
               cfg: Config, dims: ParallelDims, muon_items: Optional[list] = None) -> None:
        """``roles``: per master, its parameter's Role (weight decay, decoupled LR, Muon matrix);
        ``norm_sets``: per master, the groups its squared gradient norm is summed over (its gradient
        buffer's ``norm_groups``); ``counted``: whether this rank's copy enters the norm at all (not
        a replica counted on another rank, not a tied copy); ``muon_items``: per master, the Muon
        Item of a Muon-stepped master (None elsewhere), with --optimizer muon."""
        op, tr = cfg.optim, cfg.train
        self.dims, self.clip_grad = dims, op.clip_grad
        self.masters, self._norm_sets, self._counted = masters, norm_sets, counted
        self._used_norm_sets = agree_on_norm_sets(set(norm_sets), dims, masters[0].device if masters else "cpu")
        muon_items = muon_items or [None] * len(masters)
        # --mtp-detach-heads (the same on every rank: the norms' collectives must match): which masters the
        # MTP layers' own norm clips
        self._own = [r.own_norm for r in roles] if cfg.model.mtp_detach_heads else None
        self._adam_index = [i for i, it in enumerate(muon_items) if it is None]
        self._muon_index = [i for i, it in enumerate(muon_items) if it is not None]
        self.host = None  # --optimizer-cpu-offload: the masters (and their Adam moments) in host memory
        if op.optimizer_cpu_offload:
            self.host = offload.HostState(masters, offload.host_indices(masters, self._adam_index,
                                                                        op.optimizer_offload_fraction))
        groups: dict = {}
        for i in self._adam_index:
            r = roles[i]
            groups.setdefault((r.decay, r.decoupled, r.hidden), []).append(masters[i])
        eps_of = {False: op.adam_eps, True: op.adam_eps / mup.width_mult(cfg.model)}  # muP: hidden eps / m
        groups = [{"params": ps, "weight_decay": op.weight_decay if decay else 0.0, "decoupled": decoupled,
                   "hidden": hidden, "eps": eps_of[hidden]}
                  for (decay, decoupled, hidden), ps in sorted(groups.items(), reverse=True)]
        device = self._device()
        # the on-device step of a mixed-precision run: AdamW and the publishing copy in one Triton pass per
        # master (kernels/fused_adamw.py); --kernel-fused-adamw off: torch's fused AdamW, then the copy
        kernel = self.mixed and fused_adamw.available(device) and cfg.kernels.kernel_fused_adamw != "off" and \
            self.host is None
        groups, betas = groups or [{"params": []}], (op.adam_beta1, op.adam_beta2)
        dtypes = moments.moment_dtypes(op)
        if moments.lowered(dtypes):  # --exp-avg-dtype / --exp-avg-sq-dtype (paratron/optim/moments.py)
            kernel = kernel and moments.kernel_takes(dtypes)
            self.adam = moments.LowPrecisionAdamW(groups, op.lr, betas, op.adam_eps, dtypes, device_steps=kernel)
        else:
            # torch's fused AdamW on the GPU; with offload also for the host's masters (its CPU kernel: one pass
            # over the state instead of foreach's dozen, measured 6.5x faster on a 2-core host)
            kw = {"fused": True} if device.type == "cuda" and (self.host is None or fused_on_host()) else \
                {"foreach": True}
            self.adam = torch.optim.AdamW(groups, lr=op.lr, betas=betas, eps=op.adam_eps, **kw)
        self._fused_outs, self._adamw_tables = None, {}  # (the kernel's address tables, kept between steps)
        if kernel:
            self._fused_outs = {m: t for m, t in zip(masters, self._model_weights()) if t is not None}
        self.muon = None
        if self._muon_index:
            from .muon import Muon, qkv_rows
            self.muon = Muon([muon_items[i] for i in self._muon_index], op, dims, qkv_rows(cfg.model))
        if tr.fp16:
            self.scaler = (ConstantScaler(tr.loss_scale) if tr.loss_scale else
                           DynamicScaler(tr.initial_loss_scale, tr.min_loss_scale, tr.loss_scale_window, tr.hysteresis))
        else:
            self.scaler = ConstantScaler(1.0)

    def _device(self) -> torch.device:
        """Where the model's tensors are (an offloaded master is on the host)."""
        return self._model_tensors()[0].device if self.masters else torch.device("cpu")

    # ---- what subclasses provide ----------------------------------------------------------------
    def _model_tensors(self) -> list[torch.Tensor]:
        """Per master, the model tensor it is the master of (the parameter, or its distributed shard)."""
        raise NotImplementedError

    def _grads(self) -> list[torch.Tensor]:
        """fp32 gradients aligned with ``self.masters`` (views of the buffer where possible)."""
        raise NotImplementedError

    def _native_grads(self) -> list[torch.Tensor]:
        """The gradients aligned with ``self.masters`` in the buffers' own dtype (what ``_grads`` widens)."""
        raise NotImplementedError

    def _model_weights(self) -> list[Optional[torch.Tensor]]:
        """Per master, the bf16/fp16 model tensor _publish copies it into (None for an fp32 one, which
        the master is, or shares its storage with)."""
        raise NotImplementedError

    def _publish(self, copied: bool = False) -> None:
        """Copy the updated masters into the model parameters; ``copied``: the AdamW kernel already wrote
        them (fused_adamw.py)."""
        raise NotImplementedError

    # ---- the step -------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def set_lr(self, lr: float, decoupled_lr: Optional[float] = None, hidden_lr: Optional[float] = None) -> None:
        """The learning rate of the step; ``decoupled_lr``: that of the word embedding and output layer
        (--decoupled-lr), ``hidden_lr``: that of muP's hidden matrices; None: the same."""
        for g in self.adam.param_groups:
            if g.get("decoupled") and decoupled_lr is not None:
                g["lr"] = decoupled_lr
            else:
                g["lr"] = hidden_lr if g.get("hidden") and hidden_lr is not None else lr
        if self.muon is not None:
            self.muon.lr = lr

    def _norm_sq(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of ``grads`` (aligned with the masters) over the whole model: for each kind
        of gradient buffer (the same on every rank, see agree_on_norm_sets), the local sum over this
        rank's counted tensors, summed over the buffer's norm groups."""
        device = self._device()
        return self._model_sum(grads, lambda ts: offload.norms(ts, device).float().square().sum())

    def _model_sum(self, tensors: list[torch.Tensor], local, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``local(counted tensors)`` summed over the whole model, each element counted once (as the norm)."""
        device = self._device()
        total = torch.zeros((), device=device, dtype=dtype)
        for groups in self._used_norm_sets:
            counted = [g for g, s, c in zip(tensors, self._norm_sets, self._counted) if c and s == groups]
            part = local(counted).to(dtype) if counted else torch.zeros((), device=device, dtype=dtype)
            for name in groups:
                if self.dims.size(name) > 1:
                    dist.all_reduce(part, group=self.dims.group(name))
            total = total + part
        return total

    @torch.no_grad()
    def params_norm(self) -> float:
        """L2 norm of the fp32 master weights over the whole model (``--log-params-norm``), each
        element counted once, as the gradient norm."""
        return self._norm_sq(self.masters).sqrt().item()

    @torch.no_grad()
    def num_zeros_in_grad(self) -> int:
        """Gradient entries equal to zero over the whole model (``--log-num-zeros-in-grad``), read
        from the gradients of the last step."""
        return int(self._model_sum(self._grads(), lambda ts: sum((t == 0).sum() for t in ts), torch.float64).item())

    @torch.no_grad()
    def step(self) -> tuple[bool | torch.Tensor, float | torch.Tensor]:
        """Returns (update applied, grad norm), as Python values, or as device tensors when the step
        ran without a host sync (see _step_on_device). Skips the update on inf/nan gradients."""
        grads = self._native_grads() if self._reads_buffers() else self._grads()
        if self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        own = self._own  # --mtp-detach-heads: the model's gradients and the MTP heads', each with its own norm
        parts = [grads] if own is None else [_picked(grads, own, False), _picked(grads, own, True)]
        norms_t = [self._norm_sq(part).sqrt() for part in parts]
        if self._on_device():
            return self._step_on_device(grads, norms_t[0])
        norms = [n.item() for n in norms_t]  # one host sync: the dynamic loss scale and the skip are decided here
        norm = norms[0]
        found_inf = not all(math.isfinite(n) for n in norms)
        self.scaler.update(found_inf)
        if found_inf:
            return False, norm
        if self.clip_grad and self.clip_grad > 0:
            for part, total in zip(parts, norms):
                coeff = self.clip_grad / (total + 1e-6)
                if coeff < 1.0:
                    torch._foreach_mul_(part, coeff)
        host = self.host.grads_to_host(grads) if self.host is not None else {}
        for i in self._adam_index:
            self.masters[i].grad = host.get(i, grads[i])
        self.adam.step()
        for m in self.masters:
            m.grad = None
        if self.muon is not None:
            self.muon.step([grads[i] for i in self._muon_index])
        if self.host is not None and not self.mixed:  # (mixed: _publish copies every master)
            self.host.copy_back(self.masters, self._model_tensors())
        self._publish()
        return True, norm

    def _on_device(self) -> bool:
        """Whether the step runs without a host sync (:meth:`_step_on_device`): a fused AdamW (torch's or the
        kernel of fused_adamw.py), one gradient norm, no offloaded masters, no Muon, no dynamic loss scale."""
        return ((self.adam.defaults.get("fused") or self._fused_outs is not None) and self._own is None
                and self.host is None and self.muon is None and not isinstance(self.scaler, DynamicScaler))

    def _reads_buffers(self) -> bool:
        """Whether the step reads the gradient buffers as they are: the AdamW kernel's step on the device with no
        loss scale. Then bf16 / fp16 buffers (--grad-reduce-in-bf16) are not widened into fp32 copies first (a pass
        writing twice the buffers' bytes, read once, by the norm alone): the norm sums their squares in fp32 and
        the kernel reads them itself."""
        return self._fused_outs is not None and self.scaler.scale == 1.0 and self._on_device()

    def settle_checkpoint_views(self, loaded: bool) -> None:
        """After a checkpoint's save (``loaded`` False) or load (True): the fp32 copies of fp16 / fp8 moments it
        used are dropped, or stored back (paratron/optim/moments.py)."""
        moments.settle_views(self.adam, loaded)

    def reload_offloaded(self) -> None:
        """After loading weights: the offloaded masters of an fp32 model (no master copies in the
        checkpoint) from the model tensors."""
        if self.host is not None and not self.mixed:
            self.host.reload(self.masters, self._model_tensors())

    def _step_on_device(self, grads: list[torch.Tensor], norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same step with no host synchronisation (a fused AdamW, no dynamic loss scale): the clip
        coefficient stays a device tensor and an inf/nan norm skips the update through the fused AdamW's
        ``found_inf``. With bf16/fp16 parameters on CUDA the AdamW kernel of fused_adamw.py also writes the
        model weights (no separate publishing copy); otherwise torch's fused AdamW, then the copy. Returns
        (update applied, grad norm) as device tensors."""
        found_inf = (~torch.isfinite(norm)).float()
        grad_scale = None
        if self.clip_grad and self.clip_grad > 0:
            # Clipping inside the fused kernel, which divides each gradient by grad_scale as it reads
            # it: one pass over the gradients fewer than scaling them first.
            grad_scale = ((norm + 1e-6) / self.clip_grad).clamp(min=1.0)
        if self._fused_outs is not None:
            kernel_grads, kernel_scale = self._kernel_grads(grads, grad_scale)
            fused_adamw.adamw_step_(self.adam, self._fused_outs, kernel_scale, found_inf, self._adamw_tables,
                                    dict(zip(self.masters, kernel_grads)))
            self._publish(copied=True)
            return found_inf == 0, norm
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            self._torch_fused_step(grad_scale, found_inf)
        finally:
            for m in self.masters:
                m.grad = None
        self._publish()
        return found_inf == 0, norm

    def _kernel_grads(self, grads: list[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> tuple:
        """What the AdamW kernel reads, and what it divides each gradient by: the gradient buffers themselves, whose
        addresses stay from step to step (the kernel's tables are kept), where ``grads`` are those buffers (fp32,
        unscaled in place) or fp32 copies of narrower ones with no loss scale; narrower buffers under a loss scale
        are still scaled, so the scale joins the divisor. A mix of the two (not built by paratron) takes the copies."""
        native, scale = self._native_grads(), self.scaler.scale
        same = [n is g for n, g in zip(native, grads)]
        if all(same) or scale == 1.0:
            return native, grad_scale
        if any(same):
            return grads, grad_scale
        if grad_scale is None:
            return native, torch.full((), scale, dtype=torch.float32, device=native[0].device)
        return native, grad_scale * scale

    def _torch_fused_step(self, grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor) -> None:
        """torch's fused AdamW over the masters (their ``.grad`` set), with its ``grad_scale`` / ``found_inf``."""
        if grad_scale is not None:
            self.adam.grad_scale = grad_scale
        self.adam.found_inf = found_inf
        try:
            self.adam.step()
        finally:
            del self.adam.found_inf
            self.adam.__dict__.pop("grad_scale", None)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: Adam moments plus master copies that are not
        the model's own parameters."""
        n = sum(t.numel() * t.element_size() for s in self.adam.state.values() for t in s.values()
                if torch.is_tensor(t))
        n += self.muon.state_bytes() if self.muon is not None else 0
        own = self.masters if self.host is not None and not self.mixed else self._own_masters()
        return n + sum(m.numel() * m.element_size() for m in own)

    def host_state_bytes(self) -> int:
        """The part of state_bytes() in host memory (--optimizer-cpu-offload): offloaded masters and their
        moments (the host copies of their gradients, as many bytes as the masters, are not counted)."""
        if self.host is None:
            return 0
        ms = [self.masters[i] for i in self.host.indices]
        n = sum(t.numel() * t.element_size() for m in ms for t in self.adam.state.get(m, {}).values()
                if torch.is_tensor(t) and t.dim() > 0)
        return n + self.host.bytes(self.masters)

    def _own_masters(self) -> list[torch.Tensor]:
        return []


class Optimizer(MixedPrecisionAdam):
    """Every rank holds every master. Model parameters may be bf16/fp16; the optimizer steps fp32
    master copies whose gradients are the ``main_grad`` buffers, then copies the result back."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: Config, dims: ParallelDims,
                 names: Optional[dict] = None):
        """``names``: {parameter: its name in the model}, for the parameter-group rules of
        paratron/optim/groups.py (without it a parameter's role is read off its shape alone)."""
        from .muon import Item
        self.params = list(params)
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        masters = [p.detach().clone().float() if p.dtype != torch.float32 else p for p in self.params]
        names = names or {}
        roles = [role_of(names.get(p, ""), p.dim(), cfg.optim, cfg.model) for p in self.params]
        items = [Item(m, p, names.get(p, "")) if r.matrix else None for m, p, r in zip(masters, self.params, roles)]
        self._setup(masters, roles, [norm_groups(spec_of(p).grad_group, False) for p in self.params],
                    [spec_of(p).counts_in_norm(dims) for p in self.params], cfg, dims, items)

    def _grads(self) -> list[torch.Tensor]:
        return [p.main_grad if p.main_grad.dtype == torch.float32 else p.main_grad.float() for p in self.params]

    def _native_grads(self) -> list[torch.Tensor]:
        return [p.main_grad for p in self.params]

    def _model_weights(self) -> list[Optional[torch.Tensor]]:
        return [p if p.dtype != torch.float32 else None for p in self.params]

    def _model_tensors(self) -> list[torch.Tensor]:
        return self.params

    def _publish(self, copied: bool = False) -> None:
        if self.mixed and not copied:
            offload.copy_all(self.params, self.masters)

    def _own_masters(self) -> list[torch.Tensor]:
        return self.masters if self.mixed else []

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the model's parameters into the fp32 masters (after loading weights)."""
        if self.mixed:
            for m, p in zip(self.masters, self.params):
                m.copy_(p)
        self.reload_offloaded()


def build_optimizer(models: list, cfg: Config, dims: ParallelDims) -> MixedPrecisionAdam:
    """The optimizer of the run: distributed (ZeRO-1) with --use-distributed-optimizer, else plain.
    ``models`` are the DataParallel-wrapped model chunks of this rank."""
    if cfg.parallel.use_distributed_optimizer:
        from .distributed import DistributedOptimizer
        return DistributedOptimizer(models, cfg, dims)
    names = {p: name for m in models for name, p in m.named_parameters()}
    return Optimizer([p for m in models for p in m.params], cfg, dims, names)


def hand_built_config(model: ModelConfig, optim: OptimConfig, train: Optional[TrainConfig] = None,
                      use_distributed_optimizer: bool = False, kernels: Optional[KernelConfig] = None) -> Config:
    """What ``build_optimizer`` reads, for a model built by hand (no run config): the model's resolved config,
    the optim section, the train section's precision and loss-scale fields (default: fp32, no scaling),
    ``--use-distributed-optimizer`` (the chunks then wrapped with ``use_distributed_optimizer=True``) and the
    kernel switches. ``build_optimizer(chunks, hand_built_config(model.config, OptimConfig(lr=1e-3)), dims)``."""
    if optim.lr is None:
        raise ConfigError("the optimizer needs a learning rate: OptimConfig(lr=...)")
    return Config(model=model, optim=optim, train=train or TrainConfig(),
                  parallel=ParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
                  kernels=kernels or KernelConfig())


def fused_on_host() -> bool:
    """Whether this torch has a fused AdamW kernel for CPU tensors (torch >= 2.4)."""
    try:  # (a private helper of torch's optimizers: where it is missing, foreach as before)
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    return "cpu" in _get_fused_kernels_supported_devices()
