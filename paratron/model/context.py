"""What a layer knows besides its activations: when it is built (:class:`Parallel`: parallelism and the kernel
switches) and for one forward pass (:class:`ForwardContext`: rotary tables, mask, KV cache, CP group)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config.kernels import KernelConfig


@dataclass
class Parallel:
    """What a layer needs to know when it is built besides the model config: parallelism (from ParallelDims)
    and the kernel switches. Built by GPTModel."""
    tp_group: object = None
    tp_size: int = 1
    sequence_parallel: bool = False
    rng: object = None  # RNGTracker for dropout inside tensor-parallel regions (None at TP=1)
    dims: object = None  # the ParallelDims (MoE layers read the expert groups); None: one rank
    expert_rng: object = None  # RNGTracker of the expert-parallel stream (--moe-router-force-load-balancing)
    kernels: KernelConfig = field(default_factory=KernelConfig)  # the kernel switches (config/kernels.py)

    def fork(self):
        return self.rng.fork() if self.rng is not None else contextlib.nullcontext()

    def trackers(self) -> tuple:
        """The RNG trackers activation recomputation replays."""
        return (self.rng, self.expert_rng)


@dataclass
class ForwardContext:
    """What attention needs to know about one forward pass besides the activations. GPTModel.forward
    builds it once and passes it down the stack.

    rope: (cos, sin) broadcasting over [s, b, heads, dim], or None (no rotary embedding).
    mask: [b, 1, s, s] bool, True = may attend: the whole pattern, causality included; or None. A float mask is
        added to the scores instead (T5's relative position bias with the pattern folded in, [b, heads/TP, q, k]:
        paratron/model/t5.py ``attention_mask``; the SDPA core takes it).
    document_ids: [b, s] document of each token of packed sequences (``--reset-attention-mask``), of
        the whole sequence even under context parallelism: attention is causal within documents.
        Without CP, GPTModel turns them into ``mask``; under CP the ring's blocks mask with them.
    causal: each position attends to itself and the ones before; False: bidirectional (an encoder: every
        position attends to every key allowed by ``mask`` / ``padding_mask``). False with a mask: it says all.
    padding_mask: [b, s] bool, True = a real token: keys at False positions are never attended to (the
        queries there still compute, and their outputs are meaningless). With it, ``__post_init__`` folds
        the pattern into ``mask`` (causal: lower triangle and keys; bidirectional: [b, 1, 1, s] keys only,
        broadcast) and sets ``causal`` False, so every core that honours ``mask`` honours it (SDPA, the
        window / sink core, MLA; FlashAttention-4 hands a masked pass to SDPA). Under context parallelism
        or with a KV cache it is refused. ``padding_mask`` stays set for cores that want it as given.
    kv_cache: the inference KV cache of this pass (paratron/inference/cache.py ``CacheView``): each
        attention layer writes its keys and values into it and attends over what it holds, under ``mask``;
        a view with ``paged = True`` (inference/paged_cache.py) stores and attends itself (``attend``).
    cp: the context-parallel group (paratron/parallel/context.py) when the sequence is split over
        CP ranks: attention then runs across them (ring or all-to-all).
    memo: what layers derive from this pass once and share (a sliding-window mask).
    gemv: an inference engine's decode step through the GEMV kernels (``--kernel-decode-gemv``: triton at 1..8
        rows, auto at one row; ``Engine.gemv_at``): the dense layers' linear layers (attention's qkv and output
        projections, the MLP) run through kernels/gemv.py where it takes their shapes (CUDA, <= 8 rows), and at one
        row a layer that takes it runs as row GEMVs (``TransformerLayer.decode_row``). Never set in training.
    gemv_rows_only: with ``gemv``, only the layers that run as row GEMVs take the kernels; the others keep torch's
        (``--kernel-decode-gemv auto``: the GEMV kernels were measured on such layers only).
    """
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    mask: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None
    causal: bool = True
    padding_mask: Optional[torch.Tensor] = None
    kv_cache: object = None
    cp: object = None
    gemv: bool = False
    gemv_rows_only: bool = False
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.kv_cache is not None and self.cp is not None:
            raise NotImplementedError("ForwardContext: a KV cache under context parallelism is not implemented")
        if self.causal and self.mask is not None:
            raise ValueError("a mask is the whole attention pattern: pass causal=False with it")
        if self.cp is not None and self.mask is not None:
            raise ValueError("a dense attention mask cannot be split over context-parallel ranks: give "
                             "document_ids (--reset-attention-mask) instead")
        if self.cp is not None and not self.causal:
            raise ValueError("bidirectional attention under context parallelism is not implemented (BERT and T5 "
                             "refuse --context-parallel-size > 1)")
        if self.padding_mask is not None:
            self._fold_padding()

    @classmethod
    def bidirectional(cls, padding_mask: Optional[torch.Tensor] = None, rope=None) -> "ForwardContext":
        """An encoder's pass: every position attends to every real token (``padding_mask`` [b, s] bool, True =
        real; None: all are)."""
        return cls(rope=rope, causal=False, padding_mask=padding_mask)

    def _fold_padding(self) -> None:
        if self.cp is not None:
            raise ValueError("a padding mask under context parallelism is not implemented (BERT and T5 refuse "
                             "--context-parallel-size > 1)")
        if self.kv_cache is not None:
            raise ValueError("a padding mask with an inference KV cache is not implemented")
        pad = self.padding_mask
        if pad.dtype != torch.bool or pad.dim() != 2:
            raise ValueError(f"padding_mask must be bool [batch, seq] (True = real token), got {pad.dtype} "
                             f"{tuple(pad.shape)}")
        keys = pad[:, None, None, :]  # [b, 1, 1, s]
        if self.mask is not None:
            self.mask = self.mask & keys
        elif self.causal:
            s = pad.size(1)
            self.mask = torch.ones(s, s, dtype=torch.bool, device=pad.device).tril() & keys
        else:
            self.mask = keys
        self.causal = False
