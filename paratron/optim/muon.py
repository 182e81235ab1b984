"""Muon (``--optimizer muon``): momentum orthogonalised by a Newton-Schulz iteration, for the hidden
weight matrices (paratron/optim/groups.py says which); AdamW steps the other parameters.

The step of one matrix W with gradient G, as Megatron's TensorParallelMuon (emerging_optimizers'
OrthogonalizedOptimizer) does it, with lr and weight decay wd of the step:

    W <- W (1 - lr wd)                            (decoupled weight decay)
    M <- beta M + (1 - beta) G                    (--muon-momentum beta)
    U = (1 - beta) G + beta M  with --muon-nesterov, else U = M
    W <- W - lr * NS(U) * scale(rows, cols) * --muon-extra-scale-factor

NS normalises U by its Frobenius norm and runs --muon-num-ns-steps steps X <- aX + (bA + cA^2)X,
A = XX^T, with the (a, b, c) of --muon-coefficient-type, on the wider orientation of the matrix
(in bf16 with --muon-fp32-matmul-prec medium). scale: spectral sqrt(max(rows, cols)),
unit_rms_norm sqrt(rows/cols), shape_scaling sqrt(max(1, rows/cols)). The fused QKV weight is
orthogonalised as three matrices (queries, keys, values of every group; four with the attention
output gate) unless --muon-no-split-qkv.

The matrix must be whole: a tensor-parallel shard is all-gathered over its group (--muon-tp-mode
duplicated or distributed; blockwise orthogonalises each shard alone, as Megatron's), and with the
distributed optimizer each rank's momentum shard is all-gathered over the gradient buffer's group
(momentum stays sharded; the update is computed whole and each rank applies its own range).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_single
from ..parallel.sharding import spec_of

COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
    "cubic5": [(3.3656576, -3.3420992, 0.0), (2.5744352, -1.4957376, 0.0), (2.5368962, -1.4312570, 0.0),
               (2.4418906, -1.2764040, 0.0), (2.2230472, -0.9630650, 0.0)],
}
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")  # the others cycle through their list


def coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    base = COEFFICIENTS[kind]
    seq = itertools.chain(base, itertools.repeat(base[-1])) if kind in REPEAT_LAST else itertools.cycle(base)
    return list(itertools.islice(seq, steps))


@contextlib.contextmanager
def fp32_matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(x: torch.Tensor, steps: int, kind: str = "quintic", eps: float = 1e-15) -> torch.Tensor:
    """The orthogonalisation of the fp32 matrix ``x`` (bf16 arithmetic when the fp32 matmul precision
    is "medium", as Megatron's)."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(eps)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients(kind, steps):
        A = X @ X.mT
        if c != 0.0:
            X = torch.addmm(X, torch.addmm(A, A, A, alpha=c, beta=b), X, alpha=1.0, beta=a)
        else:
            X = torch.addmm(X, A, X, alpha=b, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    return (rows / cols) ** 0.5  # unit_rms_norm


@dataclass
class Item:
    """One tensor Muon steps: ``master`` (fp32; a flat range of ``param`` from ``start`` with the
    distributed optimizer, else the whole local tensor) and the parameter's name in the model."""
    master: torch.Tensor
    param: torch.nn.Parameter
    name: str
    start: Optional[int] = None  # first flattened element of the range (distributed optimizer)
    bucket: object = None  # the gradient-buffer bucket holding the range (distributed optimizer)


class Muon:
    def __init__(self, items: list[Item], op, dims, qkv_split: Optional[list[int]] = None):
        """``qkv_split``: row counts of one query group's parts of the fused QKV weight (query, [gate,]
        key, value), or None (no split)."""
        self.items, self.dims, self.op = items, dims, op
        self.qkv_split = qkv_split if op.muon_split_qkv else None
        self.momentum = [torch.zeros_like(it.master) for it in items]
        self.lr, self.weight_decay = op.lr, op.weight_decay
        self.buckets: Optional[list] = None  # distributed optimizer: see set_buckets

    # ---- the whole matrix --------------------------------------------------------------------
    def _matrix_splits(self, p: torch.nn.Parameter) -> list:
        """The tensor-parallel splits of ``p`` across its matrix dimensions (not the expert dimension)."""
        if self.op.muon_tp_mode == "blockwise":
            return []
        first = p.dim() - 2
        return [s for s in spec_of(p).splits if s.dim >= first and self.dims.size(s.group) > 1]

    def _orthogonalize_matrix(self, m: torch.Tensor, name: str) -> torch.Tensor:
        op = self.op
        if self.qkv_split is not None and name.endswith("linear_qkv.weight") and m.size(0) % sum(self.qkv_split) == 0:
            parts = m.view(-1, sum(self.qkv_split), m.size(1)).split(self.qkv_split, dim=1)
            outs = [self._orthogonalize_matrix(t.reshape(-1, m.size(1)), "").view(-1, n, m.size(1))
                    for t, n in zip(parts, self.qkv_split)]
            return torch.cat(outs, dim=1).view_as(m)
        with fp32_matmul_precision(op.muon_fp32_matmul_prec):
            out = newton_schulz(m, op.muon_num_ns_steps, op.muon_coefficient_type)
        return out * scale_factor(m.size(0), m.size(1), op.muon_scale_mode) * op.muon_extra_scale_factor

    def orthogonalize(self, u: torch.Tensor, p: torch.nn.Parameter, name: str) -> torch.Tensor:
        """NS(U) x scale for the local tensor ``u`` of parameter ``p``: whole over tensor parallelism,
        one matrix per expert for a stacked expert tensor; returns this rank's part."""
        splits = self._matrix_splits(p)
        for s in splits:
            group = self.dims.group(s.group)
            parts = [torch.empty_like(u) for _ in range(self.dims.size(s.group))]
            dist.all_gather(parts, u.contiguous(), group=group)
            u = torch.cat(parts, dim=s.dim)
        mats = u if u.dim() == 3 else u[None]
        out = torch.stack([self._orthogonalize_matrix(m, name) for m in mats])
        out = out if u.dim() == 3 else out[0]
        for s in reversed(splits):
            out = out.chunk(self.dims.size(s.group), dim=s.dim)[self.dims.coordinate(s.group)]
        return out

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """One step; ``grads`` aligned with the items (already unscaled and clipped)."""
        op, lr = self.op, self.lr
        updates = []
        for it, buf, g in zip(self.items, self.momentum, grads):
            if self.weight_decay:
                it.master.mul_(1.0 - lr * self.weight_decay)
            buf.lerp_(g, 1.0 - op.muon_momentum)
            updates.append(g.lerp(buf, op.muon_momentum) if op.muon_nesterov else buf)
        if self.buckets is not None:
            self._step_sharded(updates)
            return
        for it, u in zip(self.items, updates):
            it.master.add_(self.orthogonalize(u, it.param, it.name), alpha=-lr)

    def _step_sharded(self, updates: list[torch.Tensor]) -> None:
        """Distributed optimizer: per bucket holding Muon matrices, all-gather the momentum shards over
        the buffer's group, orthogonalise every matrix of the bucket, apply this rank's ranges."""
        mine: dict = {}
        for it, u in zip(self.items, updates):
            mine.setdefault(it.bucket, []).append((it, u))
        for bucket in self.buckets:
            buf = bucket.buffer
            lo, hi = bucket.shard_range()
            full = torch.zeros(bucket.numel, dtype=torch.float32, device=buf.grad_data.device)
            for it, u in mine.get(bucket, []):
                a = buf.offsets[it.param] + it.start - bucket.start
                full[a: a + u.numel()] = u.view(-1)
            if buf.n > 1:
                shard = full[lo - bucket.start: hi - bucket.start].clone()
                all_gather_single(full, shard, group=buf.group)
            for p, name in self.bucket_params[bucket]:
                a = buf.offsets[p] - bucket.start
                orth = self.orthogonalize(full[a: a + p.numel()].view(p.shape), p, name).reshape(-1)
                for it, _ in mine.get(bucket, []):
                    if it.param is p:
                        it.master.add_(orth[it.start: it.start + it.master.numel()], alpha=-self.lr)

    def set_buckets(self, bucket_params: dict) -> None:
        """Distributed optimizer: {bucket: [(parameter, name) Muon steps]} of every bucket holding any
        (the same on every rank of the bucket's group), in a fixed order."""
        self.bucket_params = bucket_params
        self.buckets = list(bucket_params)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.momentum)


def qkv_rows(m) -> list[int]:
    """Rows of one query group's parts of the fused QKV weight: queries, [gates,] key, value."""
    q = m.num_attention_heads // m.num_query_groups * m.kv_channels
    return [q, q, m.kv_channels, m.kv_channels] if m.attention_output_gate else [q, m.kv_channels, m.kv_channels]
