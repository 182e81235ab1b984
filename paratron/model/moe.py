"""Mixture-of-experts MLP (Megatron-core's MoELayer), at any expert-parallel and expert-tensor-parallel size.

A layer is a :class:`Router` (a linear map hidden -> experts, top-k over softmax or sigmoid scores),
:class:`Experts` (the experts' fc1 / fc2 stacked in one tensor each, split over the ``ep`` group by
expert and over ``etp`` inside each expert, reduced over ``edp``), and an optional shared expert (a
dense MLP every token goes through).

Tokens travel as Megatron's permutation does: the [tokens, experts] routing map is read expert by
expert, so each expert's tokens are contiguous, the experts run on their slices (one
``torch._grouped_mm`` per projection with ``--moe-grouped-gemm`` where the build has it, else one
matmul per expert), and the outputs are weighted by the router's probabilities and summed back per
token. When the experts live on several ranks (EP x expert-TP > 1), ``paratron.parallel.experts``
moves the rows there and back (alltoall or allgather dispatcher); on one rank nothing is moved.

Under tensor parallelism each TP rank routes its own share of the tokens: its sequence shard with
sequence parallelism, else the layer splits the (replicated) sequence over TP on entry and gathers
it on exit. The load-balancing losses are then computed from token counts summed over TP, so they
equal the one-rank values.

Load-balancing losses (aux_loss, seq_aux_loss, z-loss) join the training loss through
:class:`MoEAuxLossAutoScaler`: the forward value is untouched (the reported lm loss does not include
them) and the backward adds their gradient, scaled as the main loss is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import mup
from ..config import ModelConfig
from ..parallel import comm
from ..parallel.random import checkpoint
from ..parallel.experts import DISPATCHERS, ExpertLayout
from ..parallel.sharding import ShardSpec, set_spec
from ..parallel.tensor import init_normal
from . import recompute
from .layers import MLP, Parallel, latent_projections
from .moe_experts import (Experts, aligned_rows, expert_order, fused_local_experts,  # noqa: F401 (moe's API)
                          grouped_mm_usable, local_experts, padded_layout)
from .moe_wgrad import OwedWeightGrads
from .routing import RandomLogits, aux_loss_scores, sinkhorn_route, topk_route  # topk_route: also moe's API

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
METRICS = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")  # Megatron's names
BALANCE_METRIC = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` receives the gradient ``scale`` (what
    d(loss)/d(loss) is for the main loss: the loss scale over the micro-batch count). ``scale``: a number or
    a 0-dim tensor (the router's: a compiled layer reads it at run time, so a new scale compiles nothing)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale) -> torch.Tensor:
        if isinstance(scale, torch.Tensor):
            ctx.save_for_backward(aux_loss, scale)
            ctx.scale = None
        else:
            ctx.save_for_backward(aux_loss)
            ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_loss, *rest = ctx.saved_tensors
        scale = rest[0].to(aux_loss.device, aux_loss.dtype) if rest else ctx.scale
        return grad_output, torch.ones_like(aux_loss) * scale, None


def set_aux_loss_scale(routers: list, scale) -> None:
    """The backward scale of the routers' aux losses (the training loop: loss scale / micro-batches), a number
    or a 0-dim tensor, written into each router's device buffer."""
    for r in routers:
        r.aux_loss_scale.fill_(scale)


# ---- load-balancing losses and capacity (the routing itself: routing.py) -----------------------------

def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """Token counts summed over ``group`` (the ranks sharing the micro-batch's tokens; None: one)."""
    return comm.all_reduce(counts, group) if comm.group_size(group) > 1 else counts


def switch_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, group=None) -> torch.Tensor:
    """Switch-Transformer balance over all tokens: E * sum_i f_i * P_i, f_i the fraction of the
    T*k assignments that go to expert i, P_i the mean score of expert i (1 when balanced). With a
    ``group`` over which the tokens are split, the counts are summed over it and this rank's value is
    its share: the values of the group add up to the loss of all the tokens."""
    tokens, experts = scores.shape
    counts = _summed(routing_map.sum(dim=0).to(scores.dtype), group)
    tokens *= comm.group_size(group)
    return (scores.sum(dim=0) * counts).sum() * experts / (tokens * tokens * topk)


def seq_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, seq_length: int,
                 group=None) -> torch.Tensor:
    """The balance of each sequence (tokens laid out [sequence, batch]), averaged over the batch;
    ``group``: as :func:`switch_aux_loss`, the sequence split over it."""
    experts = scores.shape[1]
    s = scores.view(seq_length, -1, experts)
    counts = _summed(routing_map.view(seq_length, -1, experts).sum(dim=0).to(scores.dtype), group)  # [batch, E]
    full = seq_length * comm.group_size(group)
    return (counts * experts / (full * topk) * (s.sum(dim=0) / full)).sum(dim=1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_capacity(tokens: int, topk: int, experts: int, factor: float) -> int:
    return min(tokens, math.ceil(tokens * topk / experts * factor))


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs",
                   pad: bool = False):
    """Keep at most ``capacity`` tokens per expert: those of highest probability (``probs``) or the
    first in token order (``position``); the others are dropped (their probability 0). ``pad``: every
    expert gets exactly ``capacity`` slots, filled with unrouted tokens of weight 0."""
    tokens = probs.shape[0]
    if policy == "probs":
        rank = torch.where(routing_map, probs.float(), torch.full_like(probs, -1.0, dtype=torch.float32))
    else:  # earlier tokens first
        order = torch.arange(tokens, 0, -1, device=probs.device, dtype=torch.float32)[:, None]
        rank = torch.where(routing_map, order, -1.0 - 1.0 / order)  # unrouted (padding): below, in order too
    keep_index = torch.topk(rank, capacity, dim=0).indices  # [capacity, experts]
    keep = torch.zeros_like(routing_map).scatter(0, keep_index, True)
    new_map = keep if pad else keep & routing_map
    return probs * (keep & routing_map).to(probs.dtype), new_map


def expert_bias_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free step: raise the bias of experts below the mean load by ``rate``,
    lower those above it."""
    counts = tokens_per_expert.to(bias.dtype)
    return bias + torch.sign(counts.mean() - counts) * rate


# ---- the modules --------------------------------------------------------------------------------

class Router(nn.Module):
    """``weight`` [experts, hidden] (no bias), applied in --moe-router-dtype. Returns (probs,
    routing_map) of the tokens [tokens, hidden]; while training, attaches the load-balancing losses
    to the probabilities (they reach the router's gradient through MoEAuxLossAutoScaler) and adds
    their detached values to ``metric_sums``.

    Everything that changes between steps is a device tensor updated in place, so that a compiled layer
    neither recompiles nor reads anything back: the running sums (``metric_sums``, ``tokens_per_expert``),
    the aux losses' backward scale, and whether this forward is a recomputation (``recompute.counted``)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, partition=None, layer: int = 0, random=None):
        """``partition``: the group the micro-batch's tokens are split over (TP, CP), or None; ``layer``: the
        global index of the layer (per-layer logging); ``random``: the RNG tracker of the random logits
        of --moe-router-force-load-balancing (Megatron's expert-parallel stream)."""
        super().__init__()
        self.layer, self.random = layer, random
        self.cfg, self.topk, self.experts = cfg, cfg.moe_router_topk, cfg.num_experts
        self.partition, self.parts = partition, comm.group_size(partition)
        self.dtype = ROUTER_DTYPES[cfg.moe_router_dtype]
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        init_normal(mup.hidden_std(cfg))(self.weight.data)
        if cfg.moe_router_enable_expert_bias:  # saved in checkpoints; updated after each optimizer step
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, device=device,
                                                                  dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        # [METRICS, (sum, forward passes)] until take_metrics reads them; the aux losses' backward scale
        self.register_buffer("metric_sums", torch.zeros(len(METRICS), 2, device=device), persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones((), device=device), persistent=False)

    @property
    def metrics(self) -> dict:
        """{name: (sum, forward passes)} of the losses tracked since the last take_metrics (reads the counts on
        the host: for tests and inspection)."""
        counts = self.metric_sums[:, 1].tolist()
        return {name: (self.metric_sums[i, 0], int(counts[i])) for i, name in enumerate(METRICS) if counts[i] > 0}

    def _track(self, name: str, value: torch.Tensor, counted: torch.Tensor) -> None:
        """Adds ``value`` and one pass to the sums, times ``counted`` (0 in a recomputation: not counted twice)."""
        v = value.detach().float() * self.parts  # a share of the tokens' loss: the mean over ranks is right
        self.metric_sums[METRICS.index(name)] += torch.stack((v, torch.ones_like(v))) * counted

    def _losses(self, logits: torch.Tensor, probs: torch.Tensor, seq_length: int,
                counted: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        kind = cfg.moe_router_load_balancing_type
        if kind in BALANCE_METRIC:  # sinkhorn balances by its routing, none not at all
            scores, aux_map = aux_loss_scores(logits, self.topk, cfg.moe_router_score_function)
            loss = (switch_aux_loss(scores, aux_map, self.topk, self.partition) if kind == "aux_loss"
                    else seq_aux_loss(scores, aux_map, self.topk, seq_length, self.partition))
            self._track(BALANCE_METRIC[kind], loss, counted)
            if cfg.moe_aux_loss_coeff > 0:
                probs = MoEAuxLossAutoScaler.apply(probs, loss * cfg.moe_aux_loss_coeff, self.aux_loss_scale)
        if cfg.moe_z_loss_coeff:
            loss = z_loss(logits) / self.parts
            self._track("z_loss", loss, counted)
            probs = MoEAuxLossAutoScaler.apply(probs, loss * cfg.moe_z_loss_coeff, self.aux_loss_scale)
        return probs

    def route(self, logits: torch.Tensor):
        """(probs, routing_map) of the logits: Sinkhorn routing, or top-k (group-limited when asked)."""
        cfg = self.cfg
        if cfg.moe_router_load_balancing_type == "sinkhorn":  # Sinkhorn's choice while training (Megatron)
            return sinkhorn_route(logits, self.topk, self.training)
        return topk_route(logits, self.topk, cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                          cfg.moe_router_topk_scaling_factor, self.expert_bias, cfg.moe_router_num_groups,
                          cfg.moe_router_group_topk)

    def forward(self, x: torch.Tensor, seq_length: int):
        cfg = self.cfg
        dtype = self.dtype or x.dtype
        eps = cfg.moe_input_jitter_eps
        if eps and self.training:  # Switch Transformer's jitter, on the router's input only (the experts get x)
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)  # default generator: recompute replays it
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        if cfg.moe_router_force_load_balancing:  # N(0, 1) logits with a straight-through gradient
            with self.random.fork() if self.random is not None else contextlib.nullcontext():
                logits = RandomLogits.apply(logits)
        probs, routing_map = self.route(logits)
        training = self.training and torch.is_grad_enabled()
        counted = recompute.counted(logits.detach()) if training else None  # 0: a recomputation in backward
        if training and self.tokens_per_expert is not None:  # the router's choices (before capacity)
            self.tokens_per_expert += routing_map.sum(dim=0).float() * counted
        if cfg.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(x.shape[0], self.topk, self.experts, cfg.moe_expert_capacity_factor)
            probs, routing_map = apply_capacity(probs, routing_map, capacity, cfg.moe_token_drop_policy,
                                                cfg.moe_pad_expert_input_to_capacity)
        if training:
            probs = self._losses(logits, probs, seq_length, counted)
        return probs, routing_map

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """One aux-loss-free step from the token counts since the last one (summed over ``group``,
        the data-parallel ranks, and the TP and CP ranks sharing the tokens), which are then reset."""
        if self.expert_bias is None:
            return
        counts = _summed(self.tokens_per_expert, self.partition)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        self.expert_bias.copy_(expert_bias_update(self.expert_bias, counts, self.cfg.moe_router_bias_update_rate))
        counts.zero_()


class SharedExpert(MLP):
    """--moe-shared-expert-gate: the shared expert's output times sigmoid(x . gate_weight), one gate per
    token (Qwen2-MoE's shared_expert_gate; Megatron's SharedExpertMLP). ``gate_weight`` [1, hidden] is
    replicated over TP; under sequence parallelism it sees this rank's sequence shard, so its
    gradient is a partial sum over TP (as a LayerNorm weight's)."""

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None):
        super().__init__(cfg, par, device, dtype)
        self.gate_weight = nn.Parameter(torch.empty(1, cfg.hidden_size, device=device, dtype=dtype))
        init_normal(mup.hidden_std(cfg))(self.gate_weight.data)
        if par.sequence_parallel:
            set_spec(self.gate_weight, ShardSpec(sum_over=("tp",)))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = super().forward(x) * torch.sigmoid(F.linear(x, self.gate_weight))
        return out if residual is None else out + residual


def token_partition(par: Parallel):
    """The group whose ranks route disjoint shares of a micro-batch's tokens (the balance losses and
    counts are summed over it): TP ranks (each takes its sequence shard) and CP ranks (each holds its
    chunks of the sequence); None on one rank."""
    tp, cp = par.tp_size, par.dims.cp if par.dims is not None else 1
    if cp > 1:
        return par.dims.group("tp_cp" if tp > 1 else "cp")
    return par.tp_group if tp > 1 else None


class MoELayer(nn.Module):
    """router -> experts (+ shared expert), on activations [sequence, batch, hidden]."""

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer: int = 0):
        """``layer``: the global index of the layer (its per-layer loss tags)."""
        super().__init__()
        self.par = par
        self.router = Router(cfg, device, dtype, token_partition(par), layer, par.expert_rng)
        if par.tp_size > 1:  # a weight replicated over TP applied to a share of the tokens (CP: the dense reduce)
            set_spec(self.router.weight, ShardSpec(sum_over=("tp",)))
        self.layout = ExpertLayout.from_dims(par.dims, cfg.num_experts)
        latent = cfg.moe_latent_size  # the routed experts work in this width, between two replicated projections
        self.experts = Experts(cfg if latent is None else dataclasses.replace(cfg, hidden_size=latent), device, dtype,
                               self.layout)
        self.fc1_latent_proj, self.fc2_latent_proj = latent_projections(cfg, par.tp_size > 1, device, dtype)
        # flex (DeepEP/HybridEP kernels in Megatron) moves the same tokens to the same experts as alltoall
        kind = "alltoall" if cfg.moe_token_dispatcher_type == "flex" else cfg.moe_token_dispatcher_type
        self.dispatch = DISPATCHERS[kind] if self.layout.size > 1 else None
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_expert_intermediate_size)
            self.shared_experts = (SharedExpert(shared, par, device, dtype) if cfg.moe_shared_expert_gate
                                   else MLP(shared, par, device, dtype))
        self.recompute_shared = False  # --recompute-modules shared_experts
        # --moe-shared-expert-overlap: the shared expert computed while the alltoall dispatch's rows travel
        self.overlap_shared = (cfg.moe_shared_expert_overlap and self.shared_experts is not None
                               and self.dispatch is DISPATCHERS["alltoall"])
        # dropless: every token goes to top-k experts, so the routed pairs are known in number
        self.dropless = cfg.moe_expert_capacity_factor is None
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity  # ... or padded to capacity: known too
        self.local = local_experts
        self.permute_fusion = cfg.moe_permute_fusion  # where the experts take the grouped layout (see forward)
        self.compile_whole = True  # --torch-compile traces the layer with its transformer layer (compile_experts: not)
        # --overlap-moe-expert-parallel-comm: set by the schedule while two micro-batches take turns (parallel/turns.py)
        # and called at each all-to-all while its rows travel; read when the all-to-all runs (a backward runs under
        # a later pair of turns than its forward)
        self.exchange_turn = None
        self.takes_turns = cfg.overlap_moe_expert_parallel_comm
        # the experts' weight gradients settled under the dispatch's backward all-to-all: within the turns
        # (--delay-wgrad-compute) or alone (--overlap-dispatch-backward-with-experts-wgrad)
        self.settles_under_dispatch = cfg.overlap_dispatch_backward_with_experts_wgrad
        if cfg.delay_wgrad_compute or self.settles_under_dispatch:
            self.experts.owed = OwedWeightGrads()

    def _local_fn(self, tokens: Optional[torch.Tensor] = None):
        """The EP-1 expert path: with --moe-permute-fusion and the grouped layout, the fused permutation."""
        if self.permute_fusion and (tokens is None or self.experts.takes_grouped(tokens)):
            return fused_local_experts
        return local_experts

    def compile_experts(self, options: Optional[dict] = None) -> None:
        """--kernel-moe-compile experts (and an MoE layer outside the compiled decoder layers: MTP's): the layer
        runs eagerly, outside any compiled region around it, and its expert path (sort, grouped GEMMs, SwiGLU,
        weighted sum) is one compiled region of its own when its shapes are static (dropless routing, grouped
        GEMM)."""
        self.compile_whole = False
        if self.dropless and self.experts.grouped:
            self.local = torch.compile(self._local_fn(), dynamic=False, options=options)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Under --torch-compile traced with the transformer layer (router, expert path, shared expert), except
        the paths that read the device on the host (see _routed); with compile_experts, eager."""
        return self._forward(x, residual) if self.compile_whole else self._eager_forward(x, residual)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        return self._forward(x, residual)

    def _forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        par = self.par
        split = par.tp_size > 1 and not par.sequence_parallel  # replicated over TP: each rank takes a share
        length = x.size(0)
        if split and length % par.tp_size:  # generation (a decode step's one token, any prompt): zero rows added
            x = F.pad(x, (0, 0, 0, 0, 0, -length % par.tp_size))
        xs = comm.scatter_to_sp(x, par.tp_group) if split else x
        s, b, h = xs.shape
        tokens = xs.reshape(-1, h)
        probs, routing_map = self.router(tokens, s)
        if self.fc1_latent_proj is not None:  # --moe-latent-size: routed on the hidden width, computed in the latent
            tokens = self.fc1_latent_proj(tokens)
        out, shared = self._routed(tokens, probs, routing_map, lambda: self._shared(x[:length] if split else x))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        out = out.view(s, b, h)
        if split:
            out = comm.unscatter_from_sp(out, par.tp_group)
            x, out = x[:length], out[:length]
        if self.shared_experts is not None:
            out = out + (shared if shared is not None else self._shared(x))
        return out if residual is None else out + residual

    def _routed(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, shared_fn):
        """(the routed experts' output, the shared expert's when it ran under the dispatch, else None).
        With --moe-pad-expert-input-to-capacity every rank routes exactly ``capacity`` rows to each expert,
        so the pairs and the all-to-all's split sizes are known without reading the counts. The grouped
        expert path with a known number of pairs is traced with the layer; the others read the device on
        the host (the counts, the kept pairs, the all-to-all's split sizes) and run as eager islands."""
        capacity = None
        if self.pad_to_capacity:
            capacity = expert_capacity(tokens.shape[0], self.router.topk, self.router.experts,
                                       self.router.cfg.moe_expert_capacity_factor)
        if self.dispatch is None:  # every expert here
            assignments = tokens.shape[0] * self.router.topk if self.dropless else None
            assignments = capacity * self.router.experts if capacity is not None else assignments
            local = self.local
            if local is local_experts:  # not compiled: the fused permutation where it applies
                local = self._local_fn(tokens)
            if assignments is None or not self.experts.takes_grouped(tokens):
                return self._eager_local(local, tokens, probs, routing_map, assignments), None
            return local(self.experts, tokens, probs, routing_map, assignments), None
        return self._dispatched(tokens, probs, routing_map, shared_fn, capacity)

    @torch.compiler.disable
    def _eager_local(self, local, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                     assignments: Optional[int]) -> torch.Tensor:
        """EP 1 with shapes from the data (token dropping: ``nonzero``) or one matmul per expert (the counts)."""
        return local(self.experts, tokens, probs, routing_map, assignments)

    @torch.compiler.disable
    def _dispatched(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, shared_fn,
                    capacity: Optional[int]):
        """EP x expert-TP > 1: the dispatchers (the alltoall's split sizes are read on the host), eagerly."""
        if self.dispatch is not DISPATCHERS["alltoall"]:
            return self.dispatch(tokens, probs, routing_map, self.experts, self.layout), None
        if self.overlap_shared:  # --moe-shared-expert-overlap: the shared expert under the dispatch all-to-all
            return self.dispatch(tokens, probs, routing_map, self.experts, self.layout, shared_fn, capacity)
        return self.dispatch(tokens, probs, routing_map, self.experts, self.layout, None, capacity,
                             self._take_turn if self.takes_turns or self.settles_under_dispatch else None), None

    def _take_turn(self) -> None:
        """While an all-to-all travels: the experts' owed weight gradients (--delay-wgrad-compute or
        --overlap-dispatch-backward-with-experts-wgrad: owed between the experts' backward and the dispatch's
        backward all-to-all), then the hand-off of the turns open now, if any (see ``exchange_turn``)."""
        self.settle_wgrad()
        if self.exchange_turn is not None:
            self.exchange_turn()

    def settle_wgrad(self) -> None:
        """Compute and deliver any weight gradient the experts owe (the schedules call it at their end too)."""
        if self.experts.owed is not None:
            self.experts.owed.settle()

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (recomputed in backward with --recompute-modules shared_experts)."""
        again = self.recompute_shared and recompute.active(self)
        return checkpoint(self.shared_experts, x, rng=self.par.rng) if again else self.shared_experts(x)


# ---- what the training loop does with MoE layers ------------------------------------------------

def routers(models) -> list[Router]:
    """Every router of the model chunks (an empty list for a dense model): look them up once."""
    return [m for chunk in models for m in chunk.modules() if isinstance(m, Router)]


def before_step(routers: list, loss_scale, num_microbatches: int, per_token_loss: bool, cp: int = 1) -> None:
    """The aux losses' backward scale for the next step: the main loss's (the loss scale, over the
    micro-batch count unless the gradients are divided by the step's token count afterwards). Under
    context parallelism each rank's aux loss is its share of the sequence's and, as the main loss, is
    multiplied by CP: the gradient average over data x context parallelism divides by it."""
    set_aux_loss_scale(routers, loss_scale if per_token_loss else loss_scale * cp / num_microbatches)


def after_step(routers: list, group=None) -> None:
    """After the optimizer step: each router's aux-loss-free expert bias update."""
    for r in routers:
        r.update_expert_bias(group)


def take_metrics(routers: list, device, reduce: bool, num_layers: int) -> tuple[dict, dict]:
    """The load-balancing and z losses since the last call (the sums are reset), as Megatron's MoE
    metrics tracker reports them: (means, per_layer). ``means``: averaged over MoE layers, forward
    passes (and, with ``reduce``, all ranks). ``per_layer``: Megatron's --moe-per-layer-logging tags
    ``moe/<name>_layer_<i>`` for every layer i of the ``num_layers`` (0 where a layer has no such loss:
    a dense layer), each averaged over forward passes and ranks. Every rank must call it when
    ``reduce`` (one collective over the default group)."""
    sums = torch.zeros(num_layers, len(METRICS), 2, device=device)  # [layer, metric, (sum, count)]
    for r in routers:
        sums[r.layer] += r.metric_sums.to(device)
        r.metric_sums.zero_()
    if reduce:
        torch.distributed.all_reduce(sums)
    overall = sums.sum(dim=0).tolist()
    layers = (sums[..., 0] / sums[..., 1].clamp(min=1)).tolist()
    means, per_layer = {}, {}
    for i, name in enumerate(METRICS):
        if overall[i][1] > 0:
            means[name] = overall[i][0] / overall[i][1]
            per_layer.update({f"moe/{name}_layer_{k}": layers[k][i] for k in range(num_layers)})
    return means, per_layer
