"""The context-parallel core: the sequence is split over the CP ranks and attention runs across them, ring or
all-to-all as ``--cp-comm-type`` says (``ForwardContext.cp``, parallel/context.py), with this layer's sliding
window and sink logits. A pass over one rank (``ctx.cp`` None: the inference engine's) runs the local core:
the window / sink core when the model has one, else SDPA."""
from __future__ import annotations

import torch

from .sdpa import SDPAttention
from .windowed import WindowedAttention, needs_core_attention


class ContextParallelAttention(WindowedAttention):
    """Attention across the context-parallel ranks (no dropout: config validation refuses it under CP)."""

    context_parallel = True

    def __init__(self, cfg, par, layer_index: int = 0, device=None, dtype=None):
        super().__init__(cfg, par, layer_index, device, dtype)
        self.windowed = needs_core_attention(cfg)  # the local core: window / sink, or SDPA (which decodes)
        self.decode = None if self.windowed else self._grouped_decode(par)

    def core(self, q, k, v, ctx) -> torch.Tensor:
        if ctx.cp is None:
            return super().core(q, k, v, ctx)
        return ctx.cp.attention(q, k, v, ctx.document_ids, self.scale, window=self.window, sink=self.softmax_offset,
                                layer=self.layer_index)

    def forward(self, q, k, v, ctx, dropout_p: float = 0.0) -> torch.Tensor:
        """The local core, over one rank's whole sequence."""
        if self.windowed:
            return super().forward(q, k, v, ctx, dropout_p)
        return SDPAttention.forward(self, q, k, v, ctx, dropout_p)

    def extra_repr(self) -> str:
        return f"context parallel, {super().extra_repr()}"
