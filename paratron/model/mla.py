"""Multi-latent attention (DeepSeek-V2/V3), as Megatron-core's ``MLASelfAttention``.

Per token x (after the layer's input norm), with n heads:

* queries: ``q = W_q x`` (``--q-lora-rank`` unset: ``linear_q_proj``), or through a low-rank
  bottleneck ``q = W_qu norm_q(W_qd x)`` (``linear_q_down_proj`` to ``--q-lora-rank``, then
  ``linear_q_up_proj``); each head's query is ``--qk-head-dim`` plain dimensions followed by
  ``--qk-pos-emb-head-dim`` rotary ones;
* keys and values: ``[c, k_pe] = W_kvd x`` (``linear_kv_down_proj``), ``c`` of ``--kv-lora-rank``
  dimensions, ``k_pe`` one rotary key of ``--qk-pos-emb-head-dim`` shared by every head; then
  ``[k_nope, v] = W_kvu norm_kv(c)`` per head (``linear_kv_up_proj``), the key is ``[k_nope, rope(k_pe)]``
  and the value ``--v-head-dim`` wide;
* ``norm_q``/``norm_kv`` (``q_layernorm``/``kv_layernorm``, of ``--normalization``) exist with
  ``--qk-layernorm`` only, as in Megatron's layer specs;
* softmax scale ``mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``;
* rotary: the rotary part is de-interleaved (even dimensions, then odd) before a rotate-half rotation;
  ``--rope-type yarn`` (the default with MLA, as Megatron's) uses YaRN frequencies with
  ``--rotary-scaling-factor``, Megatron's fixed original length 4096 and betas 32/1, and multiplies
  cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; ``--rope-type rope`` is plain
  rotary (``--rotary-base``, ``--rotary-percent``).

Tensor parallelism: the up projections are column-parallel (heads split over TP), ``linear_proj``
row-parallel; the down projections and the two norms are replicated (Megatron's ``duplicated``
TELinear). Under sequence parallelism they run on this rank's part of the sequence (their gradients
summed over TP) and the shared rotary key is gathered over the sequence; without it the shared rotary
key's gradient, which each rank computes from its own heads, is summed over TP.

YaRN's formulas are paratron/model/yarn.py's, shared with ``--position-embedding-type yarn``.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import mup, recompute
from ..config import ModelConfig
from ..parallel import comm
from ..parallel.random import checkpoint
from ..parallel.tensor import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, init_normal
from .layers import ForwardContext, Norm, Parallel, Rotary, apply_rotary_interleaved, output_init, rope_inv_freq
from .yarn import YarnParams, yarn_concentration_factor, yarn_inv_freq, yarn_mscale

def mla_yarn(cfg: ModelConfig) -> YarnParams:
    """MLA's YaRN knobs: --rotary-scaling-factor / --mscale / --mscale-all-dim; the original context and
    the betas are Megatron's MLATransformerConfig values (4096, 32, 1: its command line's --yarn-* flags reach
    ordinary attention only)."""
    return YarnParams(scaling_factor=cfg.rotary_scaling_factor, mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)


def softmax_scale(cfg: ModelConfig) -> float:
    mscale = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    return mscale * mscale / math.sqrt(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)


class MLARotary(Rotary):
    """Rotary tables of MLA's rotary part (cos/sin already multiplied by YaRN's factor); Rotary's
    ``forward(seq_len, position_ids)`` -> (cos, sin) for [s, b, heads, dim]."""

    def __init__(self, cfg: ModelConfig, device=None):
        nn.Module.__init__(self)  # Rotary's own tables are for --kv-channels
        where = "meta" if torch.device(device or "cpu").type == "meta" else "cpu"
        d = cfg.qk_pos_emb_head_dim
        if (cfg.rope_type or "yarn") == "yarn":
            p = mla_yarn(cfg)
            inv, scale = yarn_inv_freq(d, cfg.rotary_base, p), yarn_concentration_factor(p)
        else:
            inv, scale = rope_inv_freq(int(d * cfg.rotary_percent), cfg.rotary_base), 1.0
        pos = torch.arange(max(cfg.max_position_embeddings, cfg.seq_length), dtype=torch.float32, device=where)
        freqs = torch.outer(pos, inv.to(where))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)


apply_mla_rotary = apply_rotary_interleaved  # MLA's rotary dimensions come in interleaved pairs (DeepSeek's weights)


class MLASelfAttention(nn.Module):
    """Multi-latent self-attention (module docstring); parameter names are Megatron's."""

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None):
        super().__init__()
        self.par, self.dropout = par, cfg.attention_dropout
        self.heads = cfg.num_attention_heads // par.tp_size
        self.qk, self.pe, self.v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank, self.scale = cfg.kv_lora_rank, softmax_scale(cfg)
        self.recompute_core = self.recompute_up = False  # --recompute-modules core_attn / mla_up_proj
        self.layer_index = 0
        n, sp, init = cfg.num_attention_heads, par.sequence_parallel, init_normal(mup.hidden_std(cfg))
        column = partial(ColumnParallelLinear, tp_group=par.tp_group, bias=False, sequence_parallel=sp,
                         init_method=init, device=device, dtype=dtype)
        replicated = partial(ReplicatedLinear, init_method=init, sequence_parallel=sp, device=device, dtype=dtype)
        norm = partial(Norm, cfg.normalization, eps=cfg.norm_epsilon, sequence_parallel=sp, device=device, dtype=dtype)
        self.lora = cfg.q_lora_rank is not None
        if self.lora:
            self.linear_q_down_proj = replicated(cfg.hidden_size, cfg.q_lora_rank)
            self.linear_q_up_proj = column(cfg.q_lora_rank, n * (self.qk + self.pe))
        else:
            self.linear_q_proj = column(cfg.hidden_size, n * (self.qk + self.pe))
        self.linear_kv_down_proj = replicated(cfg.hidden_size, self.kv_rank + self.pe)
        self.linear_kv_up_proj = column(self.kv_rank, n * (self.qk + self.v))
        self.q_layernorm = norm(size=cfg.q_lora_rank) if cfg.qk_layernorm and self.lora else None
        self.kv_layernorm = norm(size=self.kv_rank) if cfg.qk_layernorm else None
        self.linear_proj = RowParallelLinear(n * self.v, cfg.hidden_size, tp_group=par.tp_group,
                                             bias=not cfg.disable_bias_linear, sequence_parallel=sp,
                                             init_method=output_init(cfg), device=device, dtype=dtype)

    def _q_in(self, x: torch.Tensor) -> torch.Tensor:
        """The query projection's input: the normed query latent (--q-lora-rank), else x."""
        if not self.lora:
            return x
        q = self.linear_q_down_proj(x)
        return q if self.q_layernorm is None else self.q_layernorm(q)

    def _queries(self, q_in: torch.Tensor) -> torch.Tensor:
        return self.linear_q_up_proj(q_in) if self.lora else self.linear_q_proj(q_in)

    def _query_parts(self, q_in: torch.Tensor, k_pe: torch.Tensor, rope) -> tuple:
        """(q_nope, q_pe, k_pe) [s, b, heads or 1, d], the rotary parts rotated."""
        q = self._queries(q_in)
        s, b = q.shape[:2]
        q_nope, q_pe = q.view(s, b, self.heads, self.qk + self.pe).split([self.qk, self.pe], dim=-1)
        if rope is not None:
            q_pe, k_pe = apply_mla_rotary(q_pe, *rope), apply_mla_rotary(k_pe, *rope)
        return q_nope, q_pe, k_pe

    def _per_head(self, q_nope, q_pe, c, k_pe) -> tuple:
        """The per-head (q, k, v) [b, heads, s, d]: the keys' and values' up projection of the latent ``c``, the
        rotary parts joined on."""
        b = q_nope.size(1)
        k_nope, v = self.linear_kv_up_proj(c).view(-1, b, self.heads, self.qk + self.v).split([self.qk, self.v], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))

    def _up(self, q_in: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, rope) -> tuple:
        """The per-head (q, k, v) from the latents (up projections, rotary embedding): what --recompute-modules
        mla_up_proj recomputes in backward instead of keeping."""
        q_nope, q_pe, k_pe = self._query_parts(q_in, k_pe, rope)
        return self._per_head(q_nope, q_pe, c, k_pe)

    def _attend(self, qkv: tuple, ctx: ForwardContext) -> torch.Tensor:
        if self.recompute_core and self.training and torch.is_grad_enabled():
            return checkpoint(self._core, *qkv, ctx, rng=self.par.rng)
        return self._core(*qkv, ctx)

    def _keys_values(self, x: torch.Tensor):
        """(the latent c after its norm, the shared rotary key over the whole sequence [s, b, 1, pe])."""
        c, k_pe = self.linear_kv_down_proj(x).split([self.kv_rank, self.pe], dim=-1)
        if self.par.sequence_parallel:
            k_pe = comm.gather_from_sp(k_pe, self.par.tp_group)
        else:  # each rank's gradient comes from its own heads: summed over TP
            k_pe = comm.copy_to_tp(k_pe, self.par.tp_group)
        return (c if self.kv_layernorm is None else self.kv_layernorm(c)), k_pe.unsqueeze(2)

    def _core(self, q, k, v, ctx: ForwardContext):
        if ctx.cp is not None:  # the CP kernels take one head dim: values padded to the keys' (as Megatron's THD path)
            out = ctx.cp.attention(q, k, F.pad(v, (0, q.size(-1) - v.size(-1))), ctx.document_ids, self.scale,
                                   layer=getattr(self, "layer_index", None))
            return out[..., :v.size(-1)]
        p = self.dropout if self.training else 0.0
        with self.par.fork():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, dropout_p=p, is_causal=ctx.causal,
                                                  scale=self.scale)

    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the two tensors an inference KV cache keeps per token: the normed latent ``c``
        and the rotated shared key ``k_pe``, one 'head' each (the per-head keys and values are never cached)."""
        return (1, self.kv_rank), (1, self.pe)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c, k_pe = self._keys_values(x)
        q_in = self._q_in(x)
        if ctx.kv_cache is None:  # training (and a cache-less forward)
            if self.recompute_up and self.training and torch.is_grad_enabled():  # --recompute-modules mla_up_proj
                def up(a, c_, k):  # (contiguous: the core then keeps these tensors, not copies of its own)
                    return tuple(t.contiguous() for t in self._up(a, c_, k, ctx.rope))
                out = recompute.discard_output(up, (q_in, c, k_pe), lambda qkv: self._attend(qkv, ctx))
            else:
                out = self._attend(self._up(q_in, c, k_pe, ctx.rope), ctx)
            b, _, s = out.shape[:3]
            return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v))
        q_nope, q_pe, k_pe = self._query_parts(q_in, k_pe, ctx.rope)
        s, b = q_nope.shape[:2]
        if getattr(ctx.kv_cache, "paged", False):  # the paged engine: latent rows in its blocks (paged_cache.py)
            return self.linear_proj(self._paged(ctx.kv_cache, q_nope, q_pe, c, k_pe))
        # inference: cache the latent and the rotary key, attend over the cache
        c, k_pe = ctx.kv_cache.update(self.layer_index, c.permute(1, 0, 2)[:, None], k_pe.permute(1, 2, 0, 3))
        if c.size(2) > s:  # decoding / verifying: attend in the latent space (absorbed projections)
            return self.linear_proj(self._absorbed(q_nope, q_pe, c, k_pe, ctx.mask))
        c, k_pe = c[:, 0].transpose(0, 1), k_pe.permute(2, 0, 1, 3)  # the prompt pass: [T, b, ...]
        out = self._core(*self._per_head(q_nope, q_pe, c, k_pe), ctx)  # [b, heads, s, d]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v))

    def _paged(self, view, q_nope, q_pe, c, k_pe) -> torch.Tensor:
        """The absorbed attention of ``_absorbed`` over the paged engine's latent rows: the pass is one packed
        sequence (batch 1) of every request's new tokens; each attends over its own request's rows (the view's
        block tables). -> [n, 1, heads * v]."""
        w = self.linear_kv_up_proj.weight.view(self.heads, self.qk + self.v, self.kv_rank)
        q = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope[:, 0], w[:, :self.qk]), q_pe[:, 0]], dim=-1)
        rows = view.attend_latent(self.layer_index, q, torch.cat([c[:, 0], k_pe[:, 0, 0]], dim=-1), self.scale)
        out = torch.einsum("nhr,hvr->nhv", rows[..., :self.kv_rank], w[:, self.qk:])
        return out.reshape(out.size(0), 1, self.heads * self.v)

    def _absorbed(self, q_nope, q_pe, c, k_pe, mask) -> torch.Tensor:
        """Attention over the cached latents without expanding them to per-head keys and values (DeepSeek's
        absorbed decode): ``W_UK`` (the key half of ``linear_kv_up_proj``) goes into the query,
        q_nope . (W_UK c) = (W_UK^T q_nope) . c, and ``W_UV`` (its value half) applies to the attention-weighted
        latent. q_nope [s, b, heads, qk], q_pe [s, b, heads, pe]; the cache's c [b, 1, T, rank], k_pe [b, 1, T, pe];
        ``mask`` [b, 1, s, T] (True: may attend) -> [s, b, heads * v]."""
        if mask is None:
            raise ValueError("multi-latent attention over a KV cache needs the pass's mask")
        w = self.linear_kv_up_proj.weight.view(self.heads, self.qk + self.v, self.kv_rank)
        q_latent = torch.einsum("sbhd,hdr->bhsr", q_nope, w[:, :self.qk])
        scores = q_latent @ c.transpose(-1, -2) + q_pe.permute(1, 2, 0, 3) @ k_pe.transpose(-1, -2)  # [b, h, s, T]
        scores = (scores.float() * self.scale).masked_fill(~mask, float("-inf"))
        latent = torch.softmax(scores, dim=-1).to(c.dtype) @ c  # [b, heads, s, rank]
        out = torch.einsum("bhsr,hvr->sbhv", latent, w[:, self.qk:])
        return out.reshape(out.shape[0], out.shape[1], self.heads * self.v)
