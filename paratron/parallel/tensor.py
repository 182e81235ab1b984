"""Tensor-parallel layers. At tensor-parallel size 1 each is exactly nn.Linear / nn.Embedding
(same parameter shapes, same ``F.linear`` / ``F.embedding`` call, no collective).

Weights are initialised full-size on every rank from the same RNG stream, then sliced, so a model
built with any TP size holds exactly the slices of the TP=1 model built with the same seed.
Each parameter carries its :class:`~paratron.parallel.sharding.ShardSpec` (how it is split, which
groups its gradient is reduced and summed over), read by the gradient buffers, the norm and the
checkpoints: a column-parallel weight is split along dim 0 in ``chunks`` blocks (2 for SwiGLU's
[gate; up]), a row-parallel weight along dim 1; a replicated bias applied to sequence-sharded
activations has its gradient summed over the TP group.

A Column/RowParallelLinear with an ``fp8`` state (set by ``paratron.fp8.linear.attach``) runs its
own matmul in FP8 (``fp8_linear``); the collectives around it (the SP all-gather, the TP reductions)
still move the activations' dtype (bf16), and the bias and residual are added after the matmul. Under the
blockwise recipe the FP8 matmul takes the weight's ``main_grad`` where DataParallel fuses its gradient
accumulation (parallel/linear.py); the other recipes' layers are never fused.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DataError
from . import comm
from .cross_entropy import linear_cross_entropy, vocab_parallel_cross_entropy  # noqa: F401 (their old home)
from .linear import embedding, fused_wgrad, linear, main_grad_of
from ..fp8.linear import fp8_linear, fuses_wgrad
from ..kernels import gemv as gemv_kernel
from .sharding import ShardSpec, Split, local_index, set_spec, shard, spec_of


def _param(full: torch.Tensor, dim: int, chunks: int, group, blocks: Optional[tuple] = None, **spec) -> nn.Parameter:
    """This TP rank's part of ``full``: ``chunks`` equal blocks along ``dim`` (or blocks of the sizes
    ``blocks``), each split over ``group``."""
    split = Split(dim, "tp", tuple(blocks) if blocks is not None else (full.size(dim) // chunks,) * chunks)
    s = ShardSpec(splits=(split,), **spec)
    return set_spec(nn.Parameter(shard(full, s, {"tp": (comm.group_rank(group), comm.group_size(group))})), s)


def tp_param(full: torch.Tensor, group, blocks: Optional[tuple] = None, dim: int = 0) -> nn.Parameter:
    """A parameter split over TP along ``dim``: each of ``blocks`` (sizes along ``dim``; default one block) cut
    into contiguous parts, one per rank, this rank's parts concatenated (a Mamba-2 layer's per-head vectors, its
    convolution over [x, B, C])."""
    return _param(full, dim, 1, group, blocks)


def _gathered(t: torch.Tensor, split: Split, group, n: int) -> torch.Tensor:
    """``t``, split along ``split.dim`` over the ``n`` ranks of ``group``, put back together."""
    parts = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    shape = list(t.shape)
    shape[split.dim] = sum(split.blocks)
    full = torch.empty(shape, dtype=t.dtype, device=t.device)
    for r, part in enumerate(parts):
        full.index_copy_(split.dim, local_index(split, r, n).to(t.device), part)
    return full


def gather_full(p: torch.Tensor, group) -> torch.Tensor:
    """The global tensor of a parameter split over the TP ``group`` (inverse of the split done at
    construction)."""
    split = next((s for s in spec_of(p).splits if s.group == "tp"), None)
    n = comm.group_size(group)
    if split is None or n == 1:
        return p.detach()
    return _gathered(p.detach(), split, group, n)


def gather_global(p: torch.Tensor, dims) -> torch.Tensor:
    """The global tensor of a parameter: its parts gathered over every group its spec splits it over
    (TP, EP, expert-TP). Every rank of those groups must call it."""
    full = p.detach()
    for split in spec_of(p).splits:
        if dims.size(split.group) > 1:
            full = _gathered(full, split, dims.group(split.group), dims.size(split.group))
    return full


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8,
            residual: Optional[torch.Tensor] = None, cublaslt: bool = True, gemv: bool = False) -> torch.Tensor:
    """``x W^T + b (+ residual)`` (linear.linear: the weight gradient fused into ``main_grad`` where
    DataParallel asked for it; ``cublaslt``: the layer's ``--kernel-cublaslt`` switch), or with an FP8 state the
    FP8 matmul followed by the bias (the blockwise recipe's with the fusion too). ``gemv``: a decode step under
    ``--kernel-decode-gemv triton`` (no autograd): the GEMV kernel where it takes the shapes (kernels/gemv.py)."""
    if gemv and fp8 is None:
        return gemv_kernel.linear(x, weight, bias, residual)
    if fp8 is None:
        return linear(x, weight, bias, residual, cublaslt)
    if fused_wgrad(weight) and not fuses_wgrad(fp8):  # DataParallel marks none: an FP8 state attached later
        raise RuntimeError("an FP8 state was attached to a layer after DataParallel fused its weight gradient; "
                           "attach FP8 (paratron.fp8.linear.attach) before wrapping the model")
    y = fp8_linear(x, weight, fp8, main_grad_of(weight))  # (main_grad: blockwise, fused by DataParallel)
    y = y if bias is None else y + bias
    return y if residual is None else residual + y


def set_cublaslt(model: nn.Module, on: bool) -> None:
    """The ``--kernel-cublaslt`` switch of every parallel linear layer of ``model`` (set once, when the model is
    built): its GEMMs through cuBLASLt's timed choice where that runs, else torch's calls."""
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.cublaslt = on


def init_normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output rows over the TP group."""

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, chunks: int = 1,
                 init_method: Optional[Callable] = None, device=None, dtype=None, blocks: Optional[tuple] = None):
        """``chunks`` equal output blocks, or ``blocks`` of these sizes, each split over TP (fused projections)."""
        super().__init__()
        tp = comm.group_size(tp_group)
        if blocks is not None and (sum(blocks) != out_features or any(b % tp for b in blocks)):
            raise ValueError(f"output blocks {blocks} do not add up to {out_features} or are not divisible by TP {tp}")
        if blocks is None and out_features % (tp * chunks):
            raise ValueError(f"output size {out_features} not divisible by {chunks} x TP {tp}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        full = torch.empty(out_features, in_features, device=device, dtype=dtype)
        (init_method or init_normal(0.02))(full)
        self.weight = _param(full, 0, chunks, tp_group, blocks)
        if bias:
            self.bias = _param(torch.zeros(out_features, device=device, dtype=dtype), 0, chunks, tp_group, blocks)
        else:
            self.register_parameter("bias", None)
        self.fp8 = None  # an FP8State: the matmul in FP8 (paratron.fp8.linear.attach)
        self.cublaslt = True  # the --kernel-cublaslt switch (set_cublaslt)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None, gemv: bool = False) -> torch.Tensor:
        """``weight`` overrides the layer's own (a tied output layer passes the embedding table); ``gemv``: see
        ``_linear``."""
        if weight is not None and gemv:
            y = gemv_kernel.linear(self.enter(x), weight, self.bias)
        else:
            y = (_linear(self.enter(x), self.weight, self.bias, self.fp8, cublaslt=self.cublaslt, gemv=gemv)
                 if weight is None else F.linear(self.enter(x), weight, self.bias))
        return comm.gather_from_tp(y, self.tp_group) if self.gather_output else y

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the local matmul sees it: gathered over the sequence (SP) or marked for
        the backward all-reduce over TP."""
        if self.sequence_parallel:
            return comm.gather_from_sp(x, self.tp_group)
        return comm.copy_to_tp(x, self.tp_group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local={tuple(self.weight.shape)}"


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input columns; partial products summed over TP."""

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: Optional[Callable] = None, device=None, dtype=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        if in_features % tp:
            raise ValueError(f"input size {in_features} not divisible by TP {tp}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        full = torch.empty(out_features, in_features, device=device, dtype=dtype)
        (init_method or init_normal(0.02))(full)
        self.weight = _param(full, 1, 1, tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
            if sequence_parallel:  # applied to sequence-sharded outputs: partial gradients per TP rank
                set_spec(self.bias, ShardSpec(sum_over=("tp",)))
        else:
            self.register_parameter("bias", None)
        self.fp8 = None  # an FP8State: the matmul in FP8 (paratron.fp8.linear.attach)
        self.cublaslt = True  # the --kernel-cublaslt switch (set_cublaslt)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, gemv: bool = False) -> torch.Tensor:
        """``residual``: added to the output (at TP=1 without bias inside the matmul, as its C operand;
        under FP8 after the FP8 matmul); ``gemv``: see ``_linear``."""
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.tp_group)
        if comm.group_size(self.tp_group) == 1:
            return _linear(x, self.weight, self.bias, self.fp8, residual, self.cublaslt, gemv)
        return self.exit(_linear(x, self.weight, None, self.fp8, cublaslt=self.cublaslt, gemv=gemv), residual)

    def exit(self, y: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output from its local matmul ``y``: summed over TP (reduce-scattered under SP),
        then the bias and ``residual`` added."""
        if comm.group_size(self.tp_group) > 1:
            y = comm.reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else comm.reduce_from_tp(
                y, self.tp_group)
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local={tuple(self.weight.shape)}"


def check_token_ids(ids: torch.Tensor, vocab: int, what: str = "token ids") -> None:
    """Raise DataError (one line) when an id of ``ids`` is outside ``[0, vocab)``. Reads the tensor's
    min and max: free on host tensors (the data loader's batches, before they go to the GPU); on a
    GPU tensor it waits for the device, so callers check host copies."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = high if high >= vocab else low
        raise DataError(f"{what}: id {bad} is outside the vocabulary of {vocab} ids (0..{vocab - 1}); the data was "
                        "tokenized with another tokenizer or --vocab-size is too small: a vocabulary-parallel "
                        "embedding would train on zeros for it. Fix the data or the tokenizer flags "
                        "(--no-token-id-check turns this check off)")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns. Ids outside the
    table are an error (:func:`check_token_ids`) where they can be read without waiting for a
    device, i.e. on the CPU (``check_ids=False`` skips it); on GPUs the training loop checks each
    micro-batch on the host before it is copied over (``BatchLayout.prepare``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
                 init_method: Optional[Callable] = None, device=None, dtype=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"vocabulary {num_embeddings} not divisible by TP {tp}")
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.per_rank = num_embeddings // tp
        self.vocab_start = comm.group_rank(tp_group) * self.per_rank
        full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        (init_method or init_normal(0.02))(full)
        self.weight = _param(full, 0, 1, tp_group, vocab_rows=True)
        self.check_ids = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.check_ids and ids.device.type == "cpu":
            check_token_ids(ids, self.num_embeddings, "the embedding's input")
        if comm.group_size(self.tp_group) == 1:
            return embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_from_tp(out, self.tp_group)


class ReplicatedLinear(nn.Module):
    """A linear layer whose whole weight (and bias) every TP rank holds (Megatron's duplicated linear).
    ``sequence_parallel``: it sees this rank's part of the tokens, so its gradients are summed over TP."""

    def __init__(self, in_features: int, out_features: int, init_method, sequence_parallel: bool,
                 device=None, dtype=None, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        init_method(self.weight.data)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if sequence_parallel:
            for p in (self.weight, self.bias):
                if p is not None:
                    set_spec(p, ShardSpec(sum_over=("tp",)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
