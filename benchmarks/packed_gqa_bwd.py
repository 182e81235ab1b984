"""FlashAttention-4's Hopper backward with a group's query heads packed into one CTA's rows (an experiment).

With grouped keys (llama-1b: 32 query heads, 8 key / value heads) FlashAttention-4 4.0.0b10's backward runs one
CTA per (key block, query head) and adds each query head's dK / dV into fp32 accumulators that are zero-filled
before and converted after: 1.920 ms against 1.707 ms with the keys repeated to 32 heads at llama-1b's attention
(benchmarks/results/gqa_bwd_probe_20261126_223133.md). Its backward has no ``pack_gqa`` yet. Here the same kernel
class runs as if there were 8 heads of 4 x s query rows: row r = position * 4 + head-in-group, so one CTA walks
all 4 query heads of its group for its key block and keeps dK / dV in registers, written once in bf16 (the
kernel's own path for ungrouped heads). What that takes, all outside FlashAttention-4's files:
  * q and dO as CuTe tensors whose row mode is hierarchical, (4, s):(d, s-stride): the 4 heads of a group are
    adjacent in paratron's sequence-first activations, so no copy (TMA boxes d x 4 x 32);
  * LSE and dPsum in the packed row order (two 8 MB permutations after FlashAttention-4's preprocess, which also
    zero-fills the dQ accumulator, allocated in the packed order);
  * the kernel's block range and causal mask for packed rows (``_PackedBlockInfo``, ``_PackedMask``: row r is
    at position r // 4), and its sequence length from the hierarchical mode, swapped in while the kernel is
    traced (``_packed_symbols``);
  * dQ converted by FlashAttention-4's postprocess into a buffer whose packed view has uniform strides
    ([b, groups, s, 4, d] storage).
Hopper, bf16, causal self-attention of equal lengths, sequence a multiple of 128. Run as a script on the device
it checks dq / dk / dv against FlashAttention-4's own backward and times both.

Measured (H100, benchmarks/results/packed_gqa_bwd_20261126_225858.md): correct (dq within 2e-4 of its largest
value, dk / dv within 2.4e-3: bf16 roundings of fp32 sums taken in another order) but no clear gain: 1.991 ms with
the longest key blocks first, 2.050 in the plain order, against 1.973 and 2.055 for FlashAttention-4's own backward
timed before and after. Not wired in; what would make it pay is the next question (its main kernel timed alone,
the 4x longer CTAs' scheduling).

    python benchmarks/packed_gqa_bwd.py        (on the device: . benchmarks/quack_env.sh first)
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from flash_attn.cute import flash_bwd_sm90 as fb, interface as fi
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from quack import layout_utils

PACK = 4  # query heads per group (the packing factor) this module is traced for; _compiled takes others


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


def _packed_order(t: torch.Tensor, groups: int, pack: int) -> torch.Tensor:
    """[b, groups * pack, s] -> [b, groups, s * pack], row s * pack + j from head g * pack + j."""
    b, _, s = t.shape
    return t.view(b, groups, pack, s).transpose(2, 3).reshape(b, groups, s * pack)


def packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, longest_first: bool = True):
    """dq (as [b, s, heads, d], a view of a [b, groups, s, pack, d] buffer) of causal attention with grouped
    keys; dk / dv written into the given [b, s, groups, d] views. q / dout / out [b, s, heads, d] with each
    token's heads adjacent (paratron's sequence-first activations, transposed), lse [b, heads, s] fp32."""
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
    return buf.permute(0, 2, 1, 3, 4).reshape(b, s, heads, d)


def _kernels(variants: dict, calls: int = 10) -> list:
    """Markdown rows: each variant's kernels (profiled over ``calls`` calls) with their GPU ms per call."""
    from torch.profiler import ProfilerActivity, profile
    from record import at_power_limit
    rows = []
    for name, fn in variants.items():
        at_power_limit(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0)):
            ms = getattr(e, "device_time_total", 0) / 1000 / calls
            if ms >= 0.002:
                rows.append(f"| {name} | {e.key[:90]} | {e.count / calls:g} | {ms:.4f} |")
    return rows


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from record import at_power_limit, cuda_median_ms, write_record
    from paratron.model import flash_attention as fa
    b, s, h, g, d = 16, 2048, 32, 8, 64
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(s, b, h, d, device=dev, dtype=bf16).transpose(0, 1)
    k, v = (torch.randn(s, b, g, d, device=dev, dtype=bf16).transpose(0, 1) for _ in range(2))
    scale = d ** -0.5
    out, lse = fa._fwd(q, k, v, scale)
    dout = torch.randn(s, b, h, d, device=dev, dtype=bf16).transpose(0, 1)
    ref = tuple(fa._seq_first_like(t) for t in (q, k, v))
    fa._bwd_into(dout, q, k, v, out, lse, scale, *ref)
    dk, dv = (fa._seq_first_like(t) for t in (k, v))
    rows = []
    for order in (True, False):
        dq = packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, order)
        for name, mine, theirs in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
            diff = (mine.float() - theirs.float()).abs().max().item()
            rel = diff / theirs.float().abs().max().item()
            rows.append(f"| {name} ({'longest first' if order else 'plain order'}) | {diff:.3g} | {rel:.3g} |")
            print(rows[-1], flush=True)
    times = []
    for name, fn in (("FlashAttention-4 (grouped)", lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref)),
                     ("packed rows, longest first", lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv)),
                     ("packed rows, plain order", lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv, False)),
                     ("FlashAttention-4 (grouped), again", lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref))):
        at_power_limit(fn)
        times.append(f"| {name} | {cuda_median_ms(fn):.4f} |")
        print(times[-1], flush=True)
    kr, vr = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
    rep = tuple(fa._seq_first_like(t) for t in (q, kr, vr))
    kernels = _kernels({"grouped": lambda: fa._bwd_into(dout, q, k, v, out, lse, scale, *ref),
                        "repeated to 32 heads": lambda: fa._bwd_into(dout, q, kr, vr, out, lse, scale, *rep),
                        "packed, longest first": lambda: packed_bwd(dout, q, k, v, out, lse, scale, dk, dv)})
    body = "\n".join([f"b {b}, s {s}, {h} query heads, {g} groups, d {d}, causal; median of 20 after 1.5 s at the "
                      "power limit.", "", "| gradient | max abs diff vs FlashAttention-4 | relative to its max |",
                      "|---|---|---|", *rows, "", "| backward | ms |", "|---|---|", *times, "",
                      "Kernels (torch profiler, 10 calls each after 1.5 s at the power limit):", "",
                      "| variant | kernel | launches per call | GPU ms per call |", "|---|---|---|---|", *kernels])
    print(body)
    write_record(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results", "packed_gqa_bwd",
                 "FlashAttention-4's backward with packed query heads", torch.cuda.get_device_name(), {}, body)


if __name__ == "__main__":
    main()
