"""The decode step compiled with ``torch.compile`` and, on CUDA, captured once as a CUDA graph.

The step's inputs are copied into fixed tensors (the tokens [b, 1] and the slot, a 0-d tensor), the
KV cache is written in place (its buffers never move), and the graph is replayed for every token:
one launch per step instead of hundreds of kernels from Python. The graph is captured after a few
warm-up calls (which also trigger compilation) on a side stream, as CUDA graph capture requires.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config.kernels import pdl_at

WARMUP = 3


SMALL_BATCH = 1  # up to this batch size the decode step is tuned for a single row's matmuls (below)


def compile_options(batch: int, switch: str = "auto", pdl: str = "auto") -> dict:
    """Inductor options of the decode step for ``batch`` rows. At batch 1 coordinate-descent tuning also
    makes Inductor write each one-row matmul as a Triton reduction fused with its neighbours (the norm
    before it, SwiGLU, the residual add), which makes batch-1 decoding faster on an H100
    (benchmarks/results/decode_bench_llama-1b_20261126_043044.md). Inductor writes matmuls that way for one row
    only, so larger batches skip the tuning (it costs compilation time and gains nothing there). ``switch``:
    ``--kernel-decode-coordinate-descent`` (on / off force it). ``pdl``: ``--kernel-decode-pdl``; on (auto: at
    batch 1), Inductor writes its kernels for programmatic dependent launch (Hopper and later; it checks the device
    itself)."""
    on = batch <= SMALL_BATCH if switch == "auto" else switch == "on"
    options = {"coordinate_descent_tuning": True} if on else {}
    return {**options, "triton.enable_pdl": True} if pdl_at(pdl, batch) else options


ARGMAX_CHUNK = 512  # the vocabulary's chunks of chunked_argmax


def chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [b, vocab] in two passes, the maximum of each ARGMAX_CHUNK-wide chunk, then of the
    chunks' maxima: the same index (the first of the maximum, as torch's). Inductor writes a plain argmax as one
    program per row, which at batch 1 walks the whole vocabulary alone; here the first pass has a program a chunk."""
    b, v = logits.shape
    chunks = -(-v // ARGMAX_CHUNK)
    if chunks * ARGMAX_CHUNK != v:
        logits = F.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, where = logits.view(b, chunks, ARGMAX_CHUNK).max(-1)
    chunk = best.argmax(-1)
    return chunk * ARGMAX_CHUNK + where.gather(-1, chunk[:, None])[:, 0]


def with_argmax(step):
    """``step`` returning its logits and their argmax as well (greedy decoding's next tokens, computed in the
    compiled step and its CUDA graph: no kernel of its own launched between steps)."""
    def run(tokens: torch.Tensor, slot: torch.Tensor):
        logits = step(tokens, slot)
        return logits, chunked_argmax(logits)
    return run


class DecodeRunner:
    """``runner(tokens [b, 1], slot: int) -> logits [b, vocab]`` for one batch size and cache (``(logits, argmax)``
    for a step wrapped by :func:`with_argmax`)."""

    def __init__(self, step, batch: int, device, switch: str = "auto", pdl: str = "auto"):
        self.step = torch.compile(step, dynamic=False, options=compile_options(batch, switch, pdl))
        self.device = torch.device(device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.slot = torch.zeros((), dtype=torch.long, device=self.device)
        self.graph = None
        self.out = None
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, slot) -> torch.Tensor:
        """``slot``: an int, or a 0-d tensor on the device (copied there: the host does not read it)."""
        self.tokens.copy_(tokens)
        if isinstance(slot, torch.Tensor):
            self.slot.copy_(slot)
        else:
            self.slot.fill_(slot)
        if self.device.type != "cuda":
            return self.step(self.tokens, self.slot)
        if self.graph is None:
            self.calls += 1
            if self.calls <= WARMUP:
                return self._warm()
            self._capture()
        self.graph.replay()
        return self.out

    def _warm(self) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.step(self.tokens, self.slot)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.step(self.tokens, self.slot)
        self.graph = graph
