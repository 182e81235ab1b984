"""Transformer pieces: norms, rotary embedding, MLP, attention, and the forward context.

Activations are laid out [sequence, batch, hidden] (Megatron's layout: sequence parallelism splits
dimension 0). Parallel plumbing is confined to the parallel linear layers; at TP=1 this is a plain
transformer.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import mup
from ..config import ModelConfig
from ..config.kernels import KernelConfig
from ..fp8 import mlp as fp8_mlp
from ..config.kernels import parse_quack_tiles
from ..kernels import decode_attention, flash_attention, quack_gemm, quack_mlp, quack_norm
from ..kernels.rotary import apply_rotary
from ..parallel.random import checkpoint
from ..parallel.sharding import ShardSpec, set_spec
from ..parallel import comm
from ..parallel.linear import main_grad_of, mark_fusable
from ..parallel.tensor import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, init_normal
from .core_attention import CoreAttention, needs_core_attention, rope_layers
from .variants import apply_output_gate, fused_fp8_activation, is_gated, mlp_activation, qkv_parts
from .yarn import yarn_concentration_factor, yarn_inv_freq, yarn_params

SMALL_DECODE_BATCH = 1  # decode attention as matmuls up to this batch size (Attention._decode_core)


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
    mask: [b, 1, s, s] bool, True = may attend: the whole pattern, causality included; or None.
    document_ids: [b, s] document of each token of packed sequences (``--reset-attention-mask``), of
        the whole sequence even under context parallelism: attention is causal within documents.
        Without CP, GPTModel turns them into ``mask``; under CP the ring's blocks mask with them.
    causal: each position attends to itself and the ones before (False with a mask: it says all).
    kv_cache: the inference KV cache of this pass (paratron/inference/cache.py ``CacheView``): each
        attention layer writes its keys and values into it and attends over what it holds, under ``mask``.
    cp: the context-parallel group (paratron/parallel/context.py) when the sequence is split over
        CP ranks: attention then runs across them (ring or all-to-all).
    memo: what layers derive from this pass once and share (a sliding-window mask).
    """
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    mask: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None
    causal: bool = True
    kv_cache: object = None
    cp: object = None
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.kv_cache is not None and self.cp is not None:
            raise NotImplementedError("ForwardContext: a KV cache under context parallelism is not implemented")
        if self.causal and self.mask is not None:
            raise ValueError("a mask is the whole attention pattern: pass causal=False with it")
        if self.cp is not None and self.mask is not None:
            raise ValueError("a dense attention mask cannot be split over context-parallel ranks: give "
                             "document_ids (--reset-attention-mask) instead")


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight), computed in fp32. ``zero_centered``
    (``--apply-layernorm-1p``): the weight is stored as w, initialised to 0, and applied as 1 + w."""

    def __init__(self, kind: str, size: int, eps: float, sequence_parallel: bool = False, device=None, dtype=None,
                 zero_centered: bool = False, kernel: str = "auto"):
        super().__init__()
        self.kind, self.eps, self.size, self.zero_centered = kind, eps, (size,), zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(size, device=device, dtype=dtype))
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if sequence_parallel:  # applied to a share of the activations (sequence or heads): partial gradients per TP rank
            for p in self.parameters():
                set_spec(p, ShardSpec(sum_over=("tp",)))
        # quack's RMSNorm kernel in training (Hopper, bf16, rows of whole 16-byte vectors; ``kernel``: the
        # --kernel-rmsnorm switch)
        self.quack = (kernel != "torch" and kind == "RMSNorm" and not zero_centered and size % 8 == 0
                      and quack_norm.available(device, dtype))

    @classmethod
    def of(cls, cfg: ModelConfig, size: int, sequence_parallel: bool = False, device=None, dtype=None,
           kernels: Optional[KernelConfig] = None) -> "Norm":
        """The model's norm (--normalization, --norm-epsilon, --apply-layernorm-1p) over ``size`` features;
        ``kernels``: the switches (--kernel-rmsnorm)."""
        return cls(cfg.normalization, size, cfg.norm_epsilon, sequence_parallel, device, dtype,
                   zero_centered=cfg.apply_layernorm_1p, kernel=(kernels or KernelConfig()).kernel_rmsnorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # 1 + w in fp32, as Transformer Engine's zero-centred-gamma kernels
            gamma = self.weight.float() + 1.0
            if self.kind == "LayerNorm":
                return F.layer_norm(x.float(), self.size, gamma, self.bias.float(), self.eps).to(x.dtype)
            return (gamma * F.rms_norm(x.float(), self.size, eps=self.eps)).to(x.dtype)
        if self.kind == "LayerNorm":
            return F.layer_norm(x, self.size, self.weight, self.bias, self.eps)
        if self.quack and torch.is_grad_enabled() and x.is_cuda:  # (generation: the torch expression)
            return quack_norm.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.size, eps=self.eps).to(x.dtype)

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), x) for a pre-norm block whose residual is ``x``: on quack's kernel (training) the
        residual's gradient is added to x's by the norm's backward kernel instead of a separate add."""
        if self.quack and torch.is_grad_enabled():  # (quack is only ever set for a CUDA module)
            return quack_norm.rms_norm_keep(x, self.weight, self.eps)
        return self(x), x


def rope_inv_freq(dim: int, base: float, scaling: bool = False, factor: float = 8.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_positions: int = 8192) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3.1's long-context scaling when asked."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form, as Llama/GPT-NeoX), cos/sin cached. With
    ``--position-embedding-type yarn``: YaRN's frequencies, cos and sin times its attention factor
    (Megatron applies that factor to q's and k's rotation alike)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        # Computed on the CPU (the same numbers whatever the device), or not at all for a meta model.
        where = "meta" if torch.device(device or "cpu").type == "meta" else "cpu"
        factor = 1.0
        if cfg.position_embedding_type == "yarn":  # the whole head (validation refuses --rotary-percent)
            self.dim, params = cfg.kv_channels, yarn_params(cfg)
            inv = yarn_inv_freq(self.dim, cfg.rotary_base, params).to(where)
            factor = yarn_concentration_factor(params)
        else:
            self.dim = int(cfg.kv_channels * cfg.rotary_percent)
            inv = rope_inv_freq(self.dim, cfg.rotary_base, cfg.use_rope_scaling, cfg.rope_scaling_factor).to(where)
        pos = torch.arange(max(cfg.max_position_embeddings, cfg.seq_length), dtype=torch.float32, device=where)
        if cfg.rotary_seq_len_interpolation_factor:  # position interpolation: positions squeezed by the factor
            pos = pos / cfg.rotary_seq_len_interpolation_factor
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * factor).to(device), persistent=False)

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor]):
        """cos, sin shaped to broadcast over [s, b, heads, dim]."""
        if position_ids is None:
            return self.cos[:seq_len, None, None, :], self.sin[:seq_len, None, None, :]
        return self.cos[position_ids].transpose(0, 1)[:, :, None, :], self.sin[position_ids].transpose(0, 1)[:, :, None, :]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary with the rotated dimensions in interleaved pairs (RoFormer's, ``--rotary-interleaved``;
    DeepSeek's MLA weights): reordered even-then-odd, then the rotate-half rotation. Applied to queries
    and keys alike, the reordering does not change q . k, so attention equals the interleaved form's."""
    d = cos.size(-1)
    rot = torch.cat([x[..., 0:d:2], x[..., 1:d:2]], dim=-1)
    return apply_rotary(rot if d == x.size(-1) else torch.cat([rot, x[..., d:]], dim=-1), cos, sin)


def output_init(cfg: ModelConfig):
    """Megatron's scaled init for the projections that feed the residual stream."""
    return init_normal(mup.hidden_std(cfg) / math.sqrt(2.0 * cfg.num_layers))


def latent_projections(cfg: ModelConfig, split: bool, device=None, dtype=None) -> tuple:
    """--moe-latent-size: (hidden -> latent before the routed experts, latent -> hidden after them), each
    replicated over TP (``split``: each TP rank routes a share of the tokens, so their gradients are summed
    over TP), with biases unless --disable-bias-linear (Megatron's fc1/fc2_latent_proj); (None, None) without."""
    latent, h, bias = cfg.moe_latent_size, cfg.hidden_size, not cfg.disable_bias_linear
    if latent is None:
        return None, None
    return (ReplicatedLinear(h, latent, init_normal(mup.hidden_std(cfg)), split, device, dtype, bias),
            ReplicatedLinear(latent, h, output_init(cfg), split, device, dtype, bias))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None):
        super().__init__()
        bias = not cfg.disable_bias_linear
        gated = is_gated(cfg)
        self.activation = mlp_activation(cfg)
        self.fp8_act = fused_fp8_activation(cfg)  # the fused FP8 MLP's activation code (None: per layer)
        # fc1 -> SwiGLU -> fc2 as two GEMMs with the activation in their epilogues (Hopper, quack;
        # --kernel-gated-mlp): None, or the library of fc1's backward GEMMs
        k = par.kernels
        self.gated_gemm = (quack_mlp.wanted(self.fp8_act == fp8_mlp.SWIGLU, bias, device, dtype,
                                            k.kernel_gated_mlp_wgrad) if k.kernel_gated_mlp != "torch" else None)
        self.keep_act = k.kernel_keep_swiglu_activation == "on"
        self.tiles = quack_gemm.tiles(parse_quack_tiles(k.kernel_quack_tiles)) if self.gated_gemm else None
        width = cfg.ffn_hidden_size * (2 if gated else 1)
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, width, tp_group=par.tp_group, bias=bias,
                                               sequence_parallel=par.sequence_parallel,
                                               chunks=2 if gated else 1,
                                               init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group=par.tp_group, bias=bias,
                                            sequence_parallel=par.sequence_parallel, init_method=output_init(cfg),
                                            device=device, dtype=dtype)
        # their weight gradients may go straight into main_grad (the plain path's linear layers and the gated
        # GEMMs' backward honour it; fc1's only with its backward GEMMs on cuBLAS); the fused FP8 MLP's layers
        # have FP8 states, which DataParallel leaves unfused
        mark_fusable(self.linear_fc2, *(() if self.gated_gemm == "quack" else (self.linear_fc1,)))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``residual`` is added to the output (by fc2's matmul where it can)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if fp8_mlp.applies(fc1, fc2, self.fp8_act):  # the activation's output and gradient born in FP8
            return fc2.exit(fp8_mlp.fused_mlp(fc1.enter(x), fc1.weight, fc1.bias, fc2.weight, fc1.fp8, fc2.fp8,
                                              self.fp8_act), residual)
        if self.gated_gemm and quack_mlp.applies(x, fc1, fc2):
            tp1 = comm.group_size(fc2.tp_group) == 1  # fc2's GEMM adds the residual (not to a TP partial sum)
            grads = (main_grad_of(fc1.weight), main_grad_of(fc2.weight))
            y = quack_mlp.gated_mlp(fc1.enter(x), fc1.weight, fc2.weight, residual if tp1 else None,
                                    bwd=self.gated_gemm, main_grads=grads, keep_act=self.keep_act, tiles=self.tiles)
            return fc2.exit(y, None if tp1 else residual)
        return fc2(self.activation(fc1(x)), residual)


class Attention(nn.Module):
    """Self-attention with grouped query heads through torch SDPA; causal or masked as the forward
    context says.

    The fused QKV weight is laid out by query group, as Megatron's: for each group g, the rows of
    its ``heads/groups`` query heads, then its key head, then its value head (with
    ``--attention-output-gate``, as many gate heads between the queries and the key). A contiguous TP
    split therefore gives each rank whole groups with their queries.
    """

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer_index: int = 0):
        super().__init__()
        self.par = par
        self.d = cfg.kv_channels
        self.groups = cfg.num_query_groups // par.tp_size
        self.heads = cfg.num_attention_heads // par.tp_size
        self.q_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.dropout = cfg.attention_dropout
        self.recompute_core = False
        self.layer_index = layer_index  # the global layer number (its slot in an inference KV cache)
        self.scale = mup.softmax_scale(cfg, self.d)  # the scores' scale: None is the kernels' 1/sqrt(d)
        # the rotary embedding of this layer (None: --no-rope-freq makes it a NoPE layer)
        self.rotate = ((apply_rotary_interleaved if cfg.rotary_interleaved else apply_rotary)
                       if rope_layers(cfg.no_rope_freq, cfg.num_layers)[min(layer_index, cfg.num_layers - 1)] else None)
        self.gated = cfg.attention_output_gate
        self.q_rows = self.q_per_group * qkv_parts(cfg)  # query (and gate) heads per group
        qkv_out = (cfg.num_attention_heads * qkv_parts(cfg) + 2 * cfg.num_query_groups) * self.d
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, tp_group=par.tp_group,
                                               bias=(not cfg.disable_bias_linear) or cfg.add_qkv_bias,
                                               sequence_parallel=par.sequence_parallel,
                                               init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        if cfg.qk_layernorm:
            # each TP rank normalises its own heads: the weights' gradients are partial sums over TP (Megatron
            # sums them over TP in finalize_model_grads)
            partial = par.tp_size > 1
            self.q_layernorm = Norm.of(cfg, self.d, partial, device=device, dtype=dtype, kernels=par.kernels)
            self.k_layernorm = Norm.of(cfg, self.d, partial, device=device, dtype=dtype, kernels=par.kernels)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size, tp_group=par.tp_group,
                                             bias=not cfg.disable_bias_linear, sequence_parallel=par.sequence_parallel,
                                             init_method=output_init(cfg), device=device, dtype=dtype)
        mark_fusable(self.linear_qkv, self.linear_proj)  # weight gradients may go into main_grad directly
        # Sliding window / attention sinks (Megatron's core_attention.softmax_offset); None: plain SDPA
        self.core_attention = CoreAttention(cfg, par, layer_index, device, dtype) if needs_core_attention(cfg) else None
        # FlashAttention-4 for plain causal attention in training (Hopper, bf16; kernels/flash_attention.py), as
        # --attention-backend says: auto / fused (cuDNN's forward where it runs), flash; unfused / local: SDPA
        k = par.kernels
        self.flash = (k.attention_backend in ("auto", "fused", "flash") and self.core_attention is None
                      and flash_attention.wanted(self.d, device, dtype))
        self.cudnn_fwd = k.attention_backend != "flash"
        self.packed_bwd = k.kernel_packed_gqa_backward != "off"  # experimental (kernels/experimental)
        self.fused_rope = not k.no_rope_fusion
        self.decode_kernel = k.kernel_decode_attention  # auto / triton: the Triton decode kernel; sdpa

    def _core(self, q, k, v, ctx: ForwardContext):
        if ctx.cp is not None:  # the sequence is split over CP ranks (no dropout: config validation)
            core = self.core_attention  # a sliding window and / or sink logits of this layer, if any
            return ctx.cp.attention(q, k, v, ctx.document_ids, self.scale, window=core.window if core else None,
                                    sink=core.softmax_offset if core else None, layer=self.layer_index)
        p = self.dropout if self.training else 0.0
        with self.par.fork():
            if self.core_attention is not None:
                return self.core_attention(q, k, v, ctx, p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, dropout_p=p, is_causal=ctx.causal,
                                                  enable_gqa=self.groups != self.heads, scale=self.scale)

    def _flash_applies(self, ctx: ForwardContext) -> bool:
        """Plain causal attention over the whole sequence, with autograd, without dropout, not under
        --deterministic-mode (flash_attention.py says why)."""
        return (self.flash and ctx.cp is None and ctx.mask is None and ctx.causal and ctx.kv_cache is None
                and torch.is_grad_enabled() and not (self.training and self.dropout > 0)
                and not torch.are_deterministic_algorithms_enabled())

    def _fused_rope_applies(self, ctx: ForwardContext, s: int) -> bool:
        """The flash path with this layer's rotary embedding inside the attention op
        (flash_attention.rotary_causal_attention, kernels/rotary.py): the plain rotate-half rotation over the whole
        head with one cos / sin per position ([s, 1, 1, d]: no position_ids), no q / k layernorm, no output gate;
        ``--no-rope-fusion`` turns it off."""
        if not (self.fused_rope and ctx.rope is not None and self.rotate is apply_rotary and not self.gated
                and self.q_layernorm is None):
            return False
        cos, sin = ctx.rope
        return (cos.shape == sin.shape == (s, 1, 1, self.d) and not (cos.requires_grad or sin.requires_grad)
                and self._flash_applies(ctx))

    def _attend_rotary(self, qkv, ctx: ForwardContext) -> torch.Tensor:
        """qkv [s, b, groups, q_per_group + 2, d] -> [s, b, heads * d]: the rotary embedding of q and k and
        FlashAttention-4 in one op (under core recompute both are recomputed; qkv and cos / sin are kept)."""
        args = (qkv, *ctx.rope, self.scale, self.q_per_group, self.cudnn_fwd, self.packed_bwd)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            return checkpoint(flash_attention.rotary_causal_attention, *args, rng=self.par.rng)
        return flash_attention.rotary_causal_attention(*args)

    def _attend(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        """q [s, b, heads, d], k / v [s, b, groups, d] -> [s, b, heads * d]."""
        s, b = q.shape[:2]
        recompute = self.recompute_core and self.training and torch.is_grad_enabled()
        if self._flash_applies(ctx):
            if recompute:
                return checkpoint(flash_attention.causal_attention, q, k, v, self.scale, self.cudnn_fwd,
                                  rng=self.par.rng)
            return flash_attention.causal_attention(q, k, v, self.scale, self.cudnn_fwd)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if ctx.kv_cache is not None:  # inference: store this pass's keys/values, attend over the cache
            k, v = ctx.kv_cache.update(self.layer_index, k, v)
        if ctx.kv_cache is not None and s == 1 and self.groups != self.heads and self.core_attention is None:
            out = self._decode_core(q, k, v, ctx)
        elif recompute:
            out = checkpoint(self._core, q, k, v, ctx, rng=self.par.rng)
        else:
            out = self._core(q, k, v, ctx)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d)

    def _decode_core(self, q, k, v, ctx: ForwardContext):
        """One new token per row with grouped keys/values: each group's query heads attend as one
        sequence of ``q_per_group`` queries, so the cached keys/values are read once, never repeated."""
        b = q.size(0)
        grouped = q.reshape(b, self.groups, self.q_per_group, self.d)
        scale = self.scale if self.scale is not None else self.d ** -0.5
        if b <= SMALL_DECODE_BATCH and self.decode_kernel != "sdpa":
            # one row: scores and values as matmuls around one fused softmax kernel (SDPA's fused kernel
            # has a block per row and head group only). More rows: the Triton kernel (kernels/decode_attention.py;
            # faster than SDPA's at batch 32: benchmarks/results/decode_bench_llama-1b_20261126_045119.md)
            out = decode_attention.masked_attention(grouped, k, v, ctx.mask, scale)
            return out.reshape(b, self.heads, 1, self.d)
        bounds = ctx.kv_cache.bounds()
        if (bounds is not None and q.is_cuda and self.decode_kernel != "sdpa"
                and decode_attention.supported(grouped, k, v)):
            out = decode_attention.decode_attention(grouped, k, v, *bounds, scale)  # one Triton kernel
        else:
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=ctx.mask, scale=self.scale)  # mask [b,1,1,T]
        return out.reshape(b, self.heads, 1, self.d)

    takes_residual = True  # forward(x, ctx, residual): linear_proj adds it (in its matmul at TP=1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b, groups * (q_rows + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups, self.q_rows + 2, self.d)
        if self._fused_rope_applies(ctx, s):
            return self.linear_proj(self._attend_rotary(qkv, ctx), residual)
        q = qkv[:, :, :, : self.q_per_group].reshape(s, b, self.heads, self.d)
        gate = qkv[:, :, :, self.q_per_group: self.q_rows].reshape(s, b, self.heads * self.d) if self.gated else None
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if ctx.rope is not None and self.rotate is not None:
            q, k = self.rotate(q, *ctx.rope), self.rotate(k, *ctx.rope)
        out = self._attend(q, k, v, ctx)
        if gate is not None:
            out = apply_output_gate(out, gate)
        return self.linear_proj(out, residual)
