"""Causal attention's backward with grouped keys, a group's query heads packed into one CTA (Hopper, bf16).

FlashAttention-4 4.0.0b10's Hopper backward runs one CTA per (key block, query head); with grouped keys
(llama-1b: 32 query heads, 8 key / value heads) each query head adds its dK / dV into fp32 accumulators that are
zero-filled before and converted after. Here the same kernel class runs as if there were ``groups`` heads of
``q_per_group`` x s query rows (row = position * q_per_group + head in group), so one CTA walks a group's query
heads for its key block and keeps dK / dV in registers, stored once in bf16 (the kernel's own path for
ungrouped heads). At llama-1b's attention on an H100 the main kernel is faster, the dK / dV fills and
conversions are gone, and the whole backward takes less time per call
(benchmarks/results/packed_gqa_bwd_20261126_230214.md; the probe that checks and times it is kept in the git
history, benchmarks/README.md).
What it takes, outside FlashAttention-4's files:
  * q and dO as CuTe tensors whose row mode is hierarchical, (q_per_group, s):(d, s-stride): a group's heads are
    adjacent in paratron's sequence-first activations, so no copy;
  * LSE and dPsum in the packed row order (two small permutations after FlashAttention-4's preprocess, which
    also zero-fills the dQ accumulator, allocated in the packed order);
  * the kernel's block range and causal mask for packed rows (row m is at position m // q_per_group), its
    sequence length from the hierarchical mode, and its L2-swizzled scheduler (the longest key blocks first: the
    packed CTAs are 4x longer), swapped into FlashAttention-4's backward module only while the kernel is traced;
  * dQ converted by FlashAttention-4's postprocess into a [b, groups, s, q_per_group, d] buffer, whose packed
    view has uniform strides; the rotary backward reads it in place (rotary.unrotate_into_).
Numbers: dQ as FlashAttention-4's (the same atomics, in another order), dK / dV summed over the group in fp32
in registers instead of fp32 atomics: equal up to bf16 rounding (the differences at llama-1b's shape are in the
record above).
The symbols it swaps are FlashAttention-4 4.0.0b10's; ``applies`` is False for any other version. On by
default (a faster training step on Hopper: benchmarks/results/train_throughput_llama-1b_20261126_235016.md),
``--kernel-packed-gqa-backward off`` switches it off
(flash_attention.py takes it in the rotary layers' backward). Hopper, bf16, causal self-attention of equal
lengths, sequence a multiple of 128, head dimension 64 or less (the swapped-operand configuration the packed
mask is written for).
"""
from __future__ import annotations

import contextlib
import functools

import torch

VERSION = "4.0.0b10"  # the FlashAttention-4 whose module symbols are swapped while tracing


def _packed_order(t: torch.Tensor, groups: int, pack: int) -> torch.Tensor:
    """[b, groups * pack, s] -> [b, groups, s * pack], row s * pack + j from head g * pack + j."""
    b, _, s = t.shape
    return t.view(b, groups, pack, s).transpose(2, 3).reshape(b, groups, s * pack)


try:  # optional: flash-attn-4 + quack-kernels (Hopper)
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
    from dataclasses import dataclass
    from flash_attn.cute import flash_bwd_sm90 as fb, interface as fi
    from flash_attn.cute.block_info import BlockInfo
    from flash_attn.cute.mask import AttentionMask
    from flash_attn.cute.seqlen_info import SeqlenInfoQK
    from quack import layout_utils

    def _assume(s, divby):
        if isinstance(s, tuple):
            return tuple(_assume(x, divby) for x in s)
        return s if isinstance(s, int) else cute.assume(s, divby=divby)

    def _aligned(t):
        """FlashAttention-4's ``assume_tensor_aligned`` for strides that may be nested (the packed rows)."""
        if t is None:
            return None
        divby = 128 // t.element_type.width
        st = t.stride
        return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*(_assume(x, divby) for x in st[:-1]),
                                                                              st[-1])))

    class _Seqlen:
        """SeqlenInfoQK whose query length may be a hierarchical mode (its size: the packed rows)."""

        @staticmethod
        def create(batch_idx, seqlen_q_static, *args, **kwargs):
            if isinstance(seqlen_q_static, tuple):
                seqlen_q_static = cute.size(seqlen_q_static)
            return SeqlenInfoQK.create(batch_idx, seqlen_q_static, *args, **kwargs)

    def _block_info(pack: int):
        @dataclass(frozen=True)
        class _PackedBlockInfo(BlockInfo):
            """The query blocks a key block meets under the causal mask, in packed rows: from the block holding
            position n_block * tile_n (row pack * that) to the end."""

            @cute.jit
            def get_m_block_min_max(self, seqlen_info, n_block):
                return (n_block * self.tile_n * pack) // self.tile_m, cute.ceil_div(seqlen_info.seqlen_q, self.tile_m)
        return _PackedBlockInfo

    def _mask(pack: int):
        @dataclass(frozen=True)
        class _PackedMask(AttentionMask):
            """The causal mask of the swapped-operand backward (S^T tiles) with packed query rows: row m of the
            packed sequence is at position m // pack and sees keys n <= m // pack, i.e. m >= pack * n."""

            @cute.jit
            def apply_mask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                           mask_local=False, mask_mod=None, aux_tensors=None, fastdiv_mods=(None, None)):
                assert self.swap_AB and mask_causal and not mask_local and mask_mod is None
                acc = layout_utils.reshape_acc_to_mn(acc_S, transpose=True)
                ident = cute.make_identity_tensor((self.tile_n, self.tile_m))
                mine = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(ident), transpose=True)
                zero = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(ident), transpose=True)
                # element (r, c): query row m_block * tile_m + mine[0][1] + zero[r, 0][1], key n_block * tile_n +
                # mine[0][0] + zero[0, c][0]; masked where row < pack * key
                base = pack * (n_block * self.tile_n + mine[0][0]) - m_block * self.tile_m - mine[0][1]
                for c in cutlass.range(cute.size(acc.shape[1]), unroll_full=True):
                    limit = pack * zero[0, c][0] + base
                    for r in cutlass.range(cute.size(acc.shape[0]), unroll_full=True):
                        acc[r, c] = -Float32.inf if zero[r, 0][1] < limit else acc[r, c]
        return _PackedMask

    @contextlib.contextmanager
    def _packed_symbols(pack: int, longest_first: bool):
        """FlashAttention-4's backward module with the packed block range, mask and sequence length while traced;
        ``longest_first``: its L2-swizzled scheduler (each head group's key blocks in order, the longest first)
        instead of the plain one, whose order leaves the last wave with CTAs of up to 4x the grouped kernel's work."""
        names = ("BlockInfo", "AttentionMask", "SeqlenInfoQK", "assume_tensor_aligned", "SingleTileScheduler")
        saved = {n: getattr(fb, n) for n in names}
        fb.BlockInfo, fb.AttentionMask, fb.SeqlenInfoQK, fb.assume_tensor_aligned = (
            _block_info(pack), _mask(pack), _Seqlen, _aligned)
        if longest_first:
            fb.SingleTileScheduler = fb.SingleTileLPTBwdScheduler
        try:
            yield
        finally:
            for n, v in saved.items():
                setattr(fb, n, v)

    @functools.lru_cache(maxsize=None)
    def _compiled(pack: int, groups: int, d: int, longest_first: bool = True):
        """The backward kernel for ``groups`` key heads of ``pack`` query heads each, head dimension ``d``."""
        cfg = fi._tile_size_bwd_sm90(d, d, True, False)
        obj = fb.FlashAttentionBackwardSm90(
            BFloat16, d, d, 1, True, is_local=False, deterministic=False, tile_m=cfg.m_block_size,
            tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
            SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
            AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
            num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, dQ_single_wg=cfg.dQ_single_wg)
        if not cfg.SdP_swapAB:
            raise NotImplementedError("the packed mask is written for the swapped-operand configuration")

        @cute.jit
        def packed(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                   mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale: Float32,
                   stream):
            def rows(t):  # (b, s, groups * pack, d), heads adjacent -> (b, (pack, s), groups, d)
                st = t.stride
                lay = cute.make_layout((t.shape[0], (pack, t.shape[1]), groups, d),
                                       stride=(st[0], (st[2], st[1]), st[2] * pack, 1))
                return cute.make_tensor(t.iterator, lay)
            obj(rows(mQ), mK, mV, rows(mdO), mLSE, mdPsum, mdQaccum, mdK, mdV, scale, stream=stream)

        b, s, sp, acc = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

        def fake(dtype, shape, align=16):
            div = 128 // dtype.width
            stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
            return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)
        q, do = (fake(BFloat16, (b, s, groups * pack, d)) for _ in range(2))
        k, v, dk, dv = (fake(BFloat16, (b, s, groups, d)) for _ in range(4))
        lse, dpsum = (fake(Float32, (b, groups, sp)) for _ in range(2))
        dq_accum = fake(Float32, (b, groups, acc))
        with _packed_symbols(pack, longest_first):
            kernel = cute.compile(packed, q, k, v, do, lse, dpsum, dq_accum, dk, dv, Float32(1.0),
                                  make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
        return kernel, cfg

    def backward(dout, q, k, v, out, lse, scale, dk, dv, longest_first: bool = True):
        """dq as a [b, groups, s, q_per_group, d] buffer, of causal attention with grouped keys; dk / dv written
        into the given [b, s, groups, d] views. q / dout / out [b, s, heads, d] with each token's heads adjacent
        (paratron's sequence-first activations, transposed), lse [b, heads, s] fp32 (``applies`` said yes)."""
        b, s, heads, d = q.shape
        groups = k.size(2)
        pack = heads // groups
        kernel, cfg = _compiled(pack, groups, d, longest_first)
        if s % cfg.m_block_size or s % cfg.n_block_size:
            raise ValueError(f"packed_bwd: sequence {s} is not a multiple of the tiles")
        dpsum = torch.empty(b, heads, s, dtype=torch.float32, device=q.device)
        lse_log2 = torch.empty_like(dpsum)
        dq_accum = torch.empty(b, groups, pack * s * d, dtype=torch.float32, device=q.device)  # (d a multiple of 32)
        fi._bwd_preprocess(out, dout, dpsum, lse, lse_log2, dq_accum.view(b, heads, s * d), None, None, None,
                           BFloat16, d, d, cfg.m_block_size)
        kernel(q, k, v, dout, _packed_order(lse_log2, groups, pack), _packed_order(dpsum, groups, pack), dq_accum,
               dk, dv, scale)
        buf = q.new_empty(b, groups, s, pack, d)
        dq_rows = buf.view(b, groups, s * pack, d).transpose(1, 2)  # the packed rows' view, uniform strides
        threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
        fi._bwd_postprocess_convert(dq_accum, dq_rows, scale, None, None, fi._get_device_arch(), BFloat16, d,
                                    cfg.m_block_size, threads, cfg.AtomLayoutMdQ, cfg.dQ_swapAB)
        return buf

    IMPORTED = True
except Exception:  # noqa: BLE001 - not installed, or not loadable on this machine
    IMPORTED = False


@functools.lru_cache(maxsize=1)
def installed_version() -> str:
    """The installed flash-attn-4's version ("" if none); looked up once (``applies`` runs in every backward)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return ""


def pinned() -> bool:
    """The kernel's pin holds: importable, and the installed flash-attn-4 is the version it was written against."""
    return IMPORTED and installed_version() == VERSION


def applies(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor) -> bool:
    """The packed backward takes q / dout [b, s, heads, d] and k [b, s, groups, d]: importable, the
    FlashAttention-4 it was written against, CUDA bf16, grouped, each token's heads adjacent in q and dout, s a
    multiple of 128, d <= 64."""
    b, s, heads, d = q.shape
    groups = k.size(2)
    return (IMPORTED and q.is_cuda and q.dtype == torch.bfloat16 and heads > groups
            and heads % groups == 0 and s % 128 == 0 and d <= 64 and d % 32 == 0 and q.stride(2) == d
            and dout.stride(2) == d and q.stride(3) == dout.stride(3) == 1 and pinned())
