"""CUDA graphs of the paged engine's mixed steps (prompt chunks beside decodes), one per token-count bucket.

Under ``--torch-compile`` a step that carries prompt chunks runs :class:`~.paged_graphs.MixedStep`'s function,
compiled once with its sizes symbolic. It is launched from the host kernel by kernel, a few hundred launches for a
model of 16 layers, whatever the step's token count; a prefix-cache hit or a short chunk beside a few decodes
leaves the device little work, so the host's launching sets the step's time. Captured as a CUDA graph the step is
one launch.

A graph has fixed shapes, so a step of ``n`` packed tokens (MixedStep's padding token included) runs in the
smallest bucket ``T >= n`` (powers of two from 64 up to the token budget + 1, capped by
``--inference-dynamic-batching-cuda-graph-max-tokens``): the tokens after the step's own are padding tokens (id 0,
position 0, written to the scratch block's slot 0 and reading table row 0, length 1), the picked positions are
padded to ``max_requests + 1`` with the step's padding token, and the attention tiles to a bound that no step of
``T`` tokens exceeds, with empty tiles (count 0: their programs return at once). Only the step's own tokens attend
(the padding tokens past the first have no tile and their rows are dropped); every layer of a dense model works
row by row, so the padding rows change nothing in the others. MoE layers route tokens jointly (a capacity
would let padding tokens take real ones' places), so MoE models keep the compiled step without graphs for now.

Graphs are captured as :class:`~.paged_graphs.DecodeGraphs` captures them (eager warm-up calls on a side stream,
one memory pool for every bucket, inputs copied into fixed tensors from one pinned host tensor) and all of them
at start-up (:meth:`MixedGraphs.warm_up`). A step with more requests carrying prompt chunks than
``--inference-dynamic-batching-cuda-graph-mixed-prefill-count`` (0: no mixed-step graphs) or more tokens than the
largest bucket runs the compiled step as before.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..kernels.paged_attention import tile_tokens, tiles_of
from .paged_graphs import WARMUP, BucketGraphs, pinned

SMALLEST = 64


def token_buckets(max_tokens: int, cap: int) -> list[int]:
    """Token counts with a graph: 64, 128, ... and last ``max_tokens + 1`` (a step's tokens and its padding token),
    none above ``cap``."""
    top, sizes, b = min(max_tokens + 1, cap), [], SMALLEST
    while b < top:
        sizes.append(b)
        b *= 2
    return sizes + [top]


class MixedGraphs(BucketGraphs):
    """``graphs(ids, positions, slots, rows, lengths, pick, chunks, patch)`` -> logits of ``pick`` (None when the step
    has no bucket). ``capture``: False runs the padded step without a graph (what the CPU tests check: the padding
    changes no logit)."""

    def __init__(self, step, forward: Callable, prefill_count: int, max_tokens_cap: int, capture: bool = True):
        super().__init__()
        e = step.engine
        self.engine, self.forward, self.prefill_count, self.capture = e, forward, prefill_count, capture
        self.sizes = token_buckets(e.cfg.inference_dynamic_batching_max_tokens, max_tokens_cap)
        self.picks = e.cfg.inference_dynamic_batching_max_requests + 1
        self.per = tile_tokens(e.q_per_group)
        most, dev = self.sizes[-1], e.device
        # ids, positions, slots, table rows, lengths, each [tokens] (padding: 0, 0, 0, 0, 1); a bucket's slices are
        # contiguous as the compiled step's inputs are (a strided slice of a wider buffer would compile it again)
        self.cols = [torch.full((most,), v, dtype=torch.long, device=dev) for v in (0, 0, 0, 0, 1)]
        self.pick = torch.zeros(self.picks, dtype=torch.long, device=dev)
        self.tiles = torch.zeros(self.tile_bound(most), 2, dtype=torch.long, device=dev)
        self.runs = 0  # steps run in a bucket (padded; replayed from a graph when capturing)

    def tile_bound(self, t: int) -> int:
        """The most tiles a step of ``t`` tokens can have: each request's chunk adds at most one partial tile."""
        return self.picks + -(-t // self.per) + 1

    def bucket(self, n: int, prefills: int) -> Optional[int]:
        if prefills > self.prefill_count:
            return None
        return next((s for s in self.sizes if s >= n), None)

    def _step(self, t: int) -> torch.Tensor:
        return self.forward(*self._inputs(t))

    def _inputs(self, t: int):
        ids, positions, slots, rows, lengths = (c[:t] for c in self.cols)
        ids, positions = ids.view(1, t), positions.view(1, t)
        tiles = self.tiles[:self.tile_bound(t)]
        return ids, positions, slots, self.engine.tables.table, rows, lengths, self.pick, tiles

    def _fill(self, t: int, cols: list, pick: list, tiles: list) -> None:
        """The step's inputs (``cols``: ids, positions, slots, rows, lengths, the padding token included) into the
        fixed tensors, padded to bucket ``t``, in one copy each from pinned memory."""
        n = len(cols[0])
        pad = t - n
        host = pinned([c + [v] * pad for c, v in zip(cols, (0, 0, 0, 0, 1))])
        for fixed, row in zip(self.cols, host):
            fixed[:t].copy_(row, non_blocking=True)
        self.pick.copy_(pinned(pick + [n - 1] * (self.picks - len(pick))), non_blocking=True)
        bound = self.tile_bound(t)
        self.tiles[:bound].copy_(pinned(tiles + [[n - 1, 0]] * (bound - len(tiles))), non_blocking=True)

    def __call__(self, cols: list, pick: list, chunks: list, patch=None) -> Optional[torch.Tensor]:
        """Logits of the ``pick`` positions, or None when the step has no bucket (the caller runs it compiled)."""
        n = len(cols[0])
        t = self.bucket(n, sum(1 for c in chunks if c > 1))
        if t is None:
            return None
        self.runs += 1
        self._fill(t, cols, pick, tiles_of(chunks + [1], self.engine.q_per_group))
        if patch is not None:
            patch(self.cols[0][:n - 1])
        return (self._launch(t) if self.capture else self._step(t))[:len(pick)]

    def warm_up(self) -> None:
        """Capture every bucket now, on steps of padding tokens (they write into the scratch block 0)."""
        for t in self.sizes:
            zeros = [0] * t
            for _ in range(WARMUP + 1 if self.capture else 1):  # (the eager calls, then the capture)
                self([zeros, zeros, zeros, zeros, [1] * t], [t - 1], [t - 1])
