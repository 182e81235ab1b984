"""CUDA graphs of the paged engine's decode-only steps, one per batch-size bucket (GPUs only).

A step whose requests all decode (one token each, no prompt log-probabilities) has the shapes of its batch
size alone: the packed tokens [1, b], their slots, lengths and block-table rows [b]; the block tables are the
engine's own device tensor (block_tables.py, one fixed shape), read in place. Buckets are powers of two up to ``--inference-dynamic-batching-max-requests``, the
``--inference-dynamic-batching-num-cuda-graphs`` smallest of them; a step of ``r`` requests runs in the smallest
bucket >= r, its padding rows writing into the scratch block 0 and attending over it alone (their logits are
dropped). Inputs are copied into fixed tensors, the pool is written in place, and each bucket's graph is
captured after WARMUP eager calls (which let lazy initialisation happen outside the capture), into one memory
pool shared by all buckets. A step larger than the largest bucket runs as the other steps do. Under ``--torch-compile`` the step
is compiled (Inductor) before it is captured: once for batch 1 and once with the batch size symbolic for every
larger bucket (torch's automatic dynamic shapes), not once per bucket. :meth:`DecodeGraphs.warm_up` compiles and
captures every bucket before the first request (the server does it at start-up), so that no request waits for
a compilation.
"""
from __future__ import annotations

import torch

from .paged_cache import PagedView

WARMUP = 2


def pinned(rows) -> torch.Tensor:
    """``rows`` as a host tensor in pinned memory: its copies to the GPU do not wait for the device's queue (torch's
    host allocator keeps the memory until they are done); plain memory without a GPU."""
    host = torch.tensor(rows)
    return host.pin_memory() if torch.cuda.is_available() else host


def buckets(max_requests: int, count: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, ... capped at ``max_requests``, the ``count`` smallest."""
    sizes = sorted({min(1 << i, max_requests) for i in range(max_requests.bit_length() + 1)})
    return sizes[:count]


class BucketGraphs:
    """One CUDA graph per bucket of a step's size (``self._step(bucket)`` runs the step on the fixed inputs): each
    captured after WARMUP eager calls on a side stream, all into one memory pool."""

    def __init__(self):
        self.graphs: dict = {}
        self.out: dict = {}
        self.calls: dict = {}
        self.pool = None

    def _step(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def _launch(self, bucket: int) -> torch.Tensor:
        """The step at ``bucket`` (inputs filled): eager while warming up, then captured and replayed."""
        if bucket not in self.graphs:
            self.calls[bucket] = self.calls.get(bucket, 0) + 1
            if self.calls[bucket] <= WARMUP:
                return self._warm(bucket)
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.out[bucket]

    def _warm(self, bucket: int) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, bucket: int) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out[bucket] = self._step(bucket)
        self.graphs[bucket] = graph


class DecodeGraphs(BucketGraphs):
    """``graphs(ids, positions, slots, rows, lengths) -> logits [r, vocab]`` (None when ``r`` has no bucket);
    ``rows``: each request's row of the engine's block tables (block_tables.py), which the graphs read in place."""

    def __init__(self, engine, count: int):
        super().__init__()
        self.engine = engine
        self.sizes = buckets(engine.cfg.inference_dynamic_batching_max_requests, count)
        most, dev = self.sizes[-1], engine.device
        self.ids = torch.zeros(1, most, dtype=torch.long, device=dev)
        self.positions = torch.zeros(1, most, dtype=torch.long, device=dev)
        self.slots = torch.zeros(most, dtype=torch.long, device=dev)
        self.rows = torch.zeros(most, dtype=torch.long, device=dev)
        self.lengths = torch.ones(most, dtype=torch.long, device=dev)
        # --torch-compile: two compilations (batch 1, then the batch size symbolic) for all the buckets
        self.forward = torch.compile(self._forward, dynamic=None) if engine.e.compile else self._forward

    def _forward(self, ids, positions, slots, tables, rows, lengths) -> torch.Tensor:
        e = self.engine
        view = PagedView(e.cache, slots, tables, rows, lengths, e.kernel)
        return e.e._forward(ids, positions, view, None, gemv=e.e.gemv_at(ids.size(1)))[0]  # (--kernel-decode-gemv)

    def _step(self, b: int) -> torch.Tensor:
        return self.forward(self.ids[:, :b], self.positions[:, :b], self.slots[:b], self.engine.tables.table,
                            self.rows[:b], self.lengths[:b])

    def _fill(self, b: int, ids, positions, slots, rows, lengths) -> None:
        """The step's inputs into the fixed tensors, padded to ``b`` rows (one pinned host tensor; padding rows read
        the block tables' row 0, the scratch block)."""
        pad = b - len(ids)
        host = pinned([ids + [0] * pad, positions + [0] * pad, slots + [0] * pad, lengths + [1] * pad,
                       rows + [0] * pad])
        self.ids[0, :b].copy_(host[0], non_blocking=True)
        self.positions[0, :b].copy_(host[1], non_blocking=True)
        self.slots[:b].copy_(host[2], non_blocking=True)
        self.lengths[:b].copy_(host[3], non_blocking=True)
        self.rows[:b].copy_(host[4], non_blocking=True)

    def __call__(self, ids, positions, slots, rows, lengths, patch=None):
        """``patch(ids)``: fills ids on the device after they are copied in (paged_async.py)."""
        r = len(ids)
        b = next((s for s in self.sizes if s >= r), None)
        if b is None:
            return None
        self._fill(b, ids, positions, slots, rows, lengths)
        if patch is not None:
            patch(self.ids[0, :r])
        return self._launch(b)[:r]

    def warm_up(self) -> None:
        """Compile and capture every bucket now: steps of padding rows only (they write into the scratch block 0)."""
        for b in self.sizes:
            while b not in self.graphs:
                self([0] * b, [0] * b, [0] * b, [0] * b, [1] * b)


class MixedStep:
    """``--torch-compile``: the steps that are not decode-only (prompt chunks beside decodes, or more decoding
    requests than the largest bucket), compiled once with their sizes symbolic: the tokens, the requests and the
    picked positions. A padding token is added to every step (its own table row of the scratch block 0, its
    logits picked and dropped), so that none of those sizes is 1 (torch specialises sizes 0 and 1, which would
    compile again); the block tables are the engine's (block_tables.py), a fixed shape."""

    def __init__(self, engine):
        self.engine = engine
        self.forward = torch.compile(self._forward, dynamic=True)
        self.graphs = None  # CUDA graphs of these steps per token bucket (paged_mixed_graphs.py)
        if mixed_graphs_refusal(engine) is None:
            from .paged_mixed_graphs import MixedGraphs
            cfg = engine.cfg
            self.graphs = MixedGraphs(self, self.forward,
                                      cfg.inference_dynamic_batching_cuda_graph_mixed_prefill_count,
                                      cfg.inference_dynamic_batching_cuda_graph_max_tokens)

    def _forward(self, ids, positions, slots, tables, rows, lengths, pick, tiles) -> torch.Tensor:
        e = self.engine
        view = PagedView(e.cache, slots, tables, rows, lengths, e.kernel, tiles=tiles)
        return e.e._forward(ids, positions, view, None, pick=pick)[0]

    def warm_up(self) -> None:
        """Compile now (then capture the mixed-step graphs), on a step of padding tokens (the scratch block's) whose
        sizes all differ from each other and from the block tables' (w = their rows + width; w + 1 tiles, w + 3
        picks, w + 5 tokens): torch gives equal sizes one symbol, and a later step where they differ would compile
        again."""
        t, table = self.engine._tensor, self.engine.tables.table
        w = table.size(0) + table.size(1)
        zeros = [0] * (w + 5)
        self.forward(t([zeros]), t([zeros]), t(zeros), table, t(zeros), t([1] * (w + 5)), t(list(range(w + 3))),
                     t([[0, 5]] + [[i, 1] for i in range(5, w + 5)]))
        if self.graphs is not None:
            self.graphs.warm_up()

    def __call__(self, plan, ids, positions, slots, rows, lengths, pick, patch=None) -> torch.Tensor:
        """Logits of the ``pick`` positions of ``plan``'s packed tokens (``PagedEngine._pack``'s lists);
        ``patch(ids)``: fills ids on the device first (paged_async.py)."""
        e = self.engine
        at = e.tables.rows_for([seq for seq, _ in plan])
        # the step's columns with the padding token: ids, positions, slots, table rows, lengths
        cols = [ids + [0], positions + [0], slots + [0], [at[r] for r in rows] + [0], lengths + [1]]
        if self.graphs is not None:
            out = self.graphs(cols, pick, [n for _, n in plan], patch)
            if out is not None:
                return out
        t = e._tensor
        packed = t([cols[0]])
        if patch is not None:
            patch(packed[0, :len(ids)])
        out = self.forward(packed, t([cols[1]]), t(cols[2]), e.tables.table, t(cols[3]), t(cols[4]),
                           t(pick + [len(ids)]), e._tiles(plan, extra=1))
        return out[:-1]


def mixed_graphs_refusal(engine) -> "str | None":
    """Why the paged ``engine``'s mixed steps run without CUDA graphs (None: they take them)."""
    if engine.cfg.inference_dynamic_batching_cuda_graph_mixed_prefill_count == 0:
        return "off (--inference-dynamic-batching-cuda-graph-mixed-prefill-count 0)"
    if engine.device.type != "cuda":
        return "CUDA graphs need a GPU"
    if engine.e.model.config.num_experts:
        return "MoE models: not yet (padding tokens would be routed with the step's own)"
    return None
