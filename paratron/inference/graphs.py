"""The decode step compiled with ``torch.compile`` and, on CUDA, captured once as a CUDA graph.

The step's inputs are copied into fixed tensors (the tokens [b, 1] and the slot, a 0-d tensor), the
KV cache is written in place (its buffers never move), and the graph is replayed for every token:
one launch per step instead of hundreds of kernels from Python. The graph is captured after a few
warm-up calls (which also trigger compilation) on a side stream, as CUDA graph capture requires.
"""
from __future__ import annotations

import os

import torch

WARMUP = 3


class DecodeRunner:
    """``runner(tokens [b, 1], slot: int) -> logits [b, vocab]`` for one batch size and cache."""

    def __init__(self, step, batch: int, device):
        # experiment switch: Inductor's coordinate-descent tuning, which also turns one-row matmuls
        # (batch 1) into Triton reductions it can fuse with their neighbours
        options = {"coordinate_descent_tuning": True} if os.environ.get("PARATRON_DECODE_CD") == "1" else {}
        self.step = torch.compile(step, dynamic=False, options=options)
        self.device = torch.device(device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.slot = torch.zeros((), dtype=torch.long, device=self.device)
        self.graph = None
        self.out = None
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
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
