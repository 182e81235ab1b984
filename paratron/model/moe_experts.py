"""The routed experts of an MoE layer (paratron/model/moe.py): their stacked fc1 / fc2 weights, the
layout of the rows sorted by expert (grouped GEMM or one matmul per expert, bf16 or FP8), and the expert
path when every expert is on this rank, with the permutation as separate gathers or fused
(--moe-permute-fusion)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import activation_offload as offload, mup, recompute
from ..config import ModelConfig
from ..fp8 import experts as fp8_experts, experts_mlp as fp8_experts_mlp
from ..parallel.experts import ExpertLayout, aligned_rows
from ..parallel.sharding import ShardSpec, Split, set_spec, shard
from ..parallel.tensor import init_normal
from .layers import output_init
from .variants import fused_fp8_activation, is_gated, mlp_activation


class _Weight(nn.Module):
    """Holds one stacked expert tensor (so its name is experts.linear_fc1.weight, as Megatron's): this
    rank's part of the global [experts, ...] tensor, drawn full-size and cut by ``splits`` (experts
    over EP, the FFN dimension over expert-TP); gradients reduced over the expert-data-parallel group."""

    def __init__(self, shape, splits, bias_splits, init, lay: ExpertLayout, device, dtype, bias_sum_over=()):
        super().__init__()
        coords = {"ep": (lay.ep_rank, lay.ep), "etp": (lay.etp_rank, lay.etp)}

        def part(full, spec):
            return set_spec(nn.Parameter(shard(full, spec, coords)), spec)

        self.fp8 = None  # the FP8State of --fp8-format (paratron.fp8.linear.attach): grouped GEMMs in FP8
        full = torch.empty(shape, device=device, dtype=dtype)
        init(full)
        self.weight = part(full, ShardSpec(splits=splits, grad_group="edp"))
        self.bias = None
        if bias_splits is not None:
            self.bias = part(torch.zeros(shape[:2], device=device, dtype=dtype),  # [experts, outputs]
                             ShardSpec(splits=bias_splits, grad_group="edp", sum_over=bias_sum_over))


def grouped_mm_usable(x: torch.Tensor, *sizes: int) -> bool:
    """Whether torch._grouped_mm runs here: the build has it; on CUDA bf16 on sm90+; 16-byte rows. On CPU any
    dtype eagerly, bf16 under torch.compile (its meta function takes bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or any(n * x.element_size() % 16 for n in sizes):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling())


def expert_order(routing_map: torch.Tensor, assignments: Optional[int] = None):
    """(expert_index, token_index) of every routed (token, expert) pair of ``routing_map`` [tokens,
    experts], sorted by expert then token. ``assignments``: how many pairs there are when that is
    known in advance (dropless routing: tokens x top-k); the shapes are then static, so there is no
    host synchronisation and the expert path compiles."""
    by_expert = routing_map.t()
    if assignments is not None and hasattr(torch, "nonzero_static"):
        pairs = torch.nonzero_static(by_expert, size=assignments)
        return pairs[:, 0], pairs[:, 1]
    return by_expert.nonzero(as_tuple=True)


def local_experts(experts: "Experts", tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                  assignments: Optional[int]) -> torch.Tensor:
    """Every expert on this rank: tokens sorted by expert, the experts' MLPs, and the outputs weighted
    by their probabilities and summed back per token."""
    expert_index, token_index = expert_order(routing_map, assignments)
    y = experts(tokens[token_index], routing_map.sum(dim=0), expert_index)
    y = y * probs[token_index, expert_index].to(y.dtype)[:, None]
    return torch.zeros_like(tokens).index_add_(0, token_index, y)


def padded_layout(routing_map: torch.Tensor, probs: torch.Tensor, assignments: Optional[int], align: int):
    """--moe-permute-fusion's layout: for each row of the padded grouped-GEMM input (each expert's rows
    starting at a multiple of ``align``), the token it reads (``src``; padding rows read the zero row after
    the last token), the router probability it is weighted by (0 for padding), and its expert; with the
    groups' end rows. All on the device (no host synchronisation with ``assignments``)."""
    expert_index, token_index = expert_order(routing_map, assignments)
    dest, ends, size = aligned_rows(routing_map.sum(dim=0), expert_index, align)
    tokens = routing_map.shape[0]
    src = torch.full((size,), tokens, dtype=torch.long, device=probs.device).index_copy(0, dest, token_index)
    weight = probs.new_zeros(size).index_copy(0, dest, probs[token_index, expert_index])
    row_expert = torch.zeros(size, dtype=torch.long, device=probs.device).index_copy(0, dest, expert_index)
    return src, weight, row_expert, ends


def token_rows(routing_map: torch.Tensor, src: torch.Tensor, row_expert: torch.Tensor,
               top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Under dropless routing (exactly ``top_k`` experts per token): the padded rows of each token's experts in the
    layout of :func:`padded_layout` (row r reads token ``src[r]`` for expert ``row_expert[r]``), and those experts,
    both [tokens, top_k] in expert order, on the device."""
    tokens, experts = routing_map.shape
    table = torch.zeros(tokens + 1, experts, dtype=torch.long, device=src.device)  # (row ``tokens``: padding's)
    table.index_put_((src, row_expert), torch.arange(src.shape[0], device=src.device))
    chosen = torch.nonzero_static(routing_map, size=tokens * top_k)[:, 1].view(tokens, top_k)
    return table[:tokens].gather(1, chosen), chosen


def rows_at(x: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """A [size, ...] tensor of zero rows with ``x``'s rows at ``index`` (the fused FP8 experts' padded input). By
    ``index_put``, whose backward keeps the index only: ``index_copy`` keeps its whole source for its backward, a
    second copy of the rows beside the one the GEMM keeps (eager; a compiled backward keeps what it reads)."""
    return x.new_zeros(size, *x.shape[1:]).index_put((index,), x)


def over_all_rows(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """The groups' end rows with the last group extended to ``rows`` (the padding rows past it: zero rows)."""
    return torch.cat([ends[:-1], ends.new_full((1,), rows)])


class _Dispatch(torch.autograd.Function):
    """``tokens`` into the padded rows (row r reads token ``src[r]``, padding rows the zero row after the last);
    the backward sums each token's k rows' gradients (``rows`` [tokens, k]) by a gather, in fp32: no scatter-add."""

    @staticmethod
    def forward(ctx, tokens, src, rows):
        ctx.save_for_backward(rows)
        return F.pad(tokens, (0, 0, 0, 1))[src]

    @staticmethod
    def backward(ctx, g):
        rows, = ctx.saved_tensors
        return g[rows].float().sum(1).to(g.dtype), None, None


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j w[t, j] * y[rows[t, j]]``: each token's expert rows gathered and weighted, in fp32 (no
    scatter, so no atomic adds). The backward gathers too: row r's gradient is its weight times its token's
    gradient (``src``, ``row_weight``; padding rows read the zero row and weigh 0)."""

    @staticmethod
    def forward(ctx, y, w, rows, src, row_weight):
        ctx.save_for_backward(y, rows, src, row_weight)
        ctx.w_dtype = w.dtype
        out = (y[rows].float() * w.float()[..., None]).sum(1)
        # never out.to(out.dtype) (out itself): torch 2.11's compiler traced such a forward with a zero gradient
        return out if out.dtype == y.dtype else out.to(y.dtype)

    @staticmethod
    def backward(ctx, g):
        y, rows, src, row_weight = ctx.saved_tensors
        gy = gw = None
        if ctx.needs_input_grad[0]:
            gy = (F.pad(g, (0, 0, 0, 1))[src].float() * row_weight.float()[:, None]).to(y.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.float()[:, None, :] * y[rows].float()).sum(-1).to(ctx.w_dtype)
        return gy, gw, None, None, None


def fused_local_experts(experts: "Experts", tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                        assignments: Optional[int]) -> torch.Tensor:
    """:func:`local_experts` with the permutation fused (--moe-permute-fusion): one gather takes the tokens
    straight into the padded expert rows, and the outputs come back to their tokens weighted by their
    probabilities: under dropless routing by one gather of each token's k rows (:class:`_Combine`; the dispatch's
    backward gathers them too, :class:`_Dispatch`), else by one scatter-add (torch ops that Inductor fuses under
    --torch-compile)."""
    src, weight, row_expert, ends = padded_layout(routing_map, probs, assignments, experts.row_alignment())
    n = tokens.shape[0]
    if assignments is not None and assignments % n == 0 and hasattr(torch, "nonzero_static"):
        rows, chosen = token_rows(routing_map, src, row_expert, assignments // n)
        y = experts.padded(_Dispatch.apply(tokens, src, rows), ends, row_expert)
        return _Combine.apply(y, probs.gather(1, chosen), rows, src, weight.detach())
    y = experts.padded(F.pad(tokens, (0, 0, 0, 1))[src], ends, row_expert)
    out = tokens.new_zeros(n + 1, tokens.shape[1])
    return out.index_add_(0, src, y * weight.to(y.dtype)[:, None])[:-1]


class Experts(nn.Module):
    """This rank's experts' MLPs, parts of fc1 [experts, ffn (x2 with SwiGLU), hidden] and fc2
    [experts, hidden, ffn]: experts [first, first + local) of ``lay``, fc1 by output rows and fc2 by
    input columns over expert-TP (then fc2's outputs are partial sums, and its bias is added on
    expert-TP rank 0 only)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, lay: Optional[ExpertLayout] = None):
        super().__init__()
        lay = lay or ExpertLayout(cfg.num_experts)
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
        blocks = (f, f) if is_gated(cfg) else (f,)
        bias = not cfg.disable_bias_linear
        by_expert = Split(0, "ep", (e,))
        fc1_ffn, fc2_ffn = Split(1, "etp", blocks), Split(2, "etp", (f,))
        self.linear_fc1 = _Weight((e, sum(blocks), h), (by_expert, fc1_ffn), (by_expert, fc1_ffn) if bias else None,
                                  init_normal(mup.hidden_std(cfg)), lay, device, dtype)
        self.linear_fc2 = _Weight((e, h, f), (by_expert, fc2_ffn), (by_expert,) if bias else None, output_init(cfg),
                                  lay, device, dtype, bias_sum_over=("etp",) if lay.etp > 1 else ())
        self.fc2_bias_here = lay.etp_rank == 0
        self.activation = mlp_activation(cfg)
        self.fp8_act = fused_fp8_activation(cfg)  # the fused FP8 experts MLP's activation code (None: per layer)
        self.grouped = cfg.moe_grouped_gemm
        self.used_grouped_mm: Optional[bool] = None  # which path the last forward took
        self.recompute_act = False  # --recompute-modules moe_act: the activation's output is not kept
        self.permute_fusion = cfg.moe_permute_fusion  # the alltoall dispatcher reads it (duck-typed)
        self.owed = None  # --delay-wgrad-compute: the layer's OwedWeightGrads (moe_wgrad.py), set by MoELayer

    def _mm(self, x: torch.Tensor, w: torch.Tensor, counts, rows, fp8=None) -> torch.Tensor:
        """x [tokens sorted by expert, in] times each expert's w [out, in]^T; ``rows``: the padded
        layout of :func:`aligned_rows` (grouped GEMM), or None (one matmul per expert); ``counts``: a
        list of rows per expert (or a tensor of them), or per expert a list of rows per source rank (the
        alltoall dispatcher under --deterministic-mode: each matmul then takes one source's rows, the rows a run
        without expert parallelism gives that expert in one micro-batch, so a GPU GEMM whose result for a row
        depends on the call's row count gives the same bits as there); ``fp8``: the weight's FP8State."""
        if rows is not None:
            dest, ends, size = rows
            # index_copy keeps x for its backward beside the padded copy the GEMM keeps (rows_at does not);
            # --recompute-modules moe_act drops that copy of the activation and recomputes it
            padded = x.new_zeros(size, x.shape[1]).index_copy(0, dest, x)
            if fp8 is not None:
                return fp8_experts.fp8_grouped_mm(padded, w, ends, fp8)[dest]
            return self._grouped(padded, w, ends)[dest]
        counts = counts if isinstance(counts, list) else counts.tolist()
        # unbind, not w[i]: its backward stacks the experts' gradients once, where each w[i]'s would write a
        # whole [experts, out, in] gradient (quadratic in the experts)
        ws = w.unbind(0)
        if counts and isinstance(counts[0], list):  # [expert][source rank]: one matmul per expert and source
            owner = [i for i, per_source in enumerate(counts) for _ in per_source]
            return torch.cat([p @ ws[i].t() for i, p in zip(owner, torch.split(x, sum(counts, [])))])
        return torch.cat([p @ ws[i].t() for i, p in enumerate(torch.split(x, counts))])

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert_index: torch.Tensor,
                host_counts: Optional[list] = None) -> torch.Tensor:
        """``x``: the tokens sorted by (local) expert, ``counts[i]`` of them for expert i (``host_counts``:
        the same as a list, when known, or split further by source rank: see :meth:`_mm`); ``expert_index`` the
        expert of each row."""
        grouped = self.takes_grouped(x)  # FP8 experts always take the grouped layout (no per-expert loop)
        self.used_grouped_mm = grouped
        rows = aligned_rows(counts, expert_index, self.row_alignment()) if grouped else None  # no host sync
        counts = host_counts if host_counts is not None else counts
        if rows is not None and self.fused_fp8():  # both GEMMs at once, on the padded rows (last group extended)
            dest, ends, size = rows
            padded = rows_at(x, dest, size)
            return self._fused_fp8(padded, over_all_rows(ends, size))[dest]
        return self._ffn(x, lambda a, m: self._mm(a, m.weight, counts, rows, m.fp8), expert_index)

    def row_alignment(self) -> int:
        """Each expert's rows start at a multiple of this in the grouped layout (FP8: its recipes', the larger where
        --te-precision-config-file gave fc1 and fc2 two: a blockwise tile along the rows never holds two experts)."""
        states = [m.fp8 for m in (self.linear_fc1, self.linear_fc2) if m.fp8 is not None]
        return max([fp8_experts.alignment(s) for s in states], default=8)

    def takes_grouped(self, x: torch.Tensor) -> bool:
        """Whether the experts run as grouped GEMMs on ``x``'s device and dtype (always when either is in FP8)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return fc1.fp8 is not None or fc2.fp8 is not None or (
            self.grouped and grouped_mm_usable(x, fc1.weight.shape[1], fc1.weight.shape[2], fc2.weight.shape[1]))

    def padded(self, x: torch.Tensor, ends: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
        """The experts on rows already in the padded grouped layout (:func:`padded_layout`). The grouped GEMM
        writes no row past the last group (in its output nor in its input's gradient), so the last group is
        extended over the rows past it: they are padding rows, which read the zero row, so every row of the
        output and of the gradients is written, with values nothing reads (their weight is 0, their gradient 0),
        and no pass over the rows has to mask them (no uninitialised memory reaches a bias gradient or an FP8
        amax)."""
        self.used_grouped_mm = True
        ends = over_all_rows(ends, x.shape[0])
        if self.fused_fp8():
            return self._fused_fp8(x, ends)

        def mm(a: torch.Tensor, m: _Weight) -> torch.Tensor:
            if m.fp8 is not None:
                return fp8_experts.fp8_grouped_mm(a, m.weight, ends, m.fp8)
            return self._grouped(a, m.weight, ends)
        return self._ffn(x, mm, row_expert)

    def fused_fp8(self) -> bool:
        """Whether fc1 -> activation -> fc2 run as the fused FP8 experts MLP (fp8/experts_mlp.py)."""
        return self.fp8_path() == "fused"

    def fp8_path(self) -> Optional[str]:
        """None without FP8; "fused" where the fused FP8 experts MLP applies and nothing asks for the activation on
        its own (recomputed, offloaded, its weight gradient delayed); else why not (the start-up line's words)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if fc1.fp8 is None and fc2.fp8 is None:
            return None
        own = ((self.recompute_act, "--recompute-modules moe_act"), (self.owed is not None, "--delay-wgrad-compute"),
               (bool(self.__dict__.get("offload_points")), "--offload-modules"))
        why = next((w for on, w in own if on), None)
        return why or fp8_experts_mlp.why_not(fc1.fp8, fc2.fp8, self.fp8_act, fc1.bias is not None) or "fused"

    def _fused_fp8(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return fp8_experts_mlp.fused_experts_mlp(x, fc1.weight, fc2.weight, ends, fc1.fp8, fc2.fp8, self.fp8_act)

    def _grouped(self, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """a [rows in the grouped layout, in] times each expert's w [out, in]^T (--delay-wgrad-compute: the
        weight's gradient owed until the layer settles it)."""
        if self.owed is not None:
            return self.owed.mm(a, w, ends)
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

    def _ffn(self, x: torch.Tensor, mm, expert_index: torch.Tensor) -> torch.Tensor:
        """fc1 -> activation -> fc2 with ``mm(rows, weight module)`` for the grouped matmuls."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        with offload.at(self, "expert_fc1"):  # (--offload-modules: model/activation_offload.py)
            h = mm(x, fc1)
        if fc1.bias is not None:
            h = h + fc1.bias[expert_index]
        if self.recompute_act and recompute.active(self):
            out = recompute.discard_output(self._act, h, lambda a: mm(a, fc2))
        else:
            with offload.at(self, "moe_act"):
                a = self._act(h)
            out = mm(a, fc2)
        return out + fc2.bias[expert_index] if fc2.bias is not None and self.fc2_bias_here else out

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """The activation between fc1 and fc2 (what --recompute-modules moe_act recomputes)."""
        return self.activation(h)
