"""The QKV GEMM with the rotary embedding of queries and keys in its epilogue (Hopper, bf16): an experiment,
measured and not wired into the model (docs/performance.md, seventh round: bit-identical, 0.640 against 0.664 ms
for cuBLAS + rotate_qk at llama-1b's shape, ~0.1 % of the step; benchmarks/rope_gemm_bench.py runs it).

Attention's QKV GEMM writes Megatron's grouped layout [tokens, groups, (q_per_group + 2), d]; the rotary
embedding then reads the query and key heads back and writes them rotated (rope_kernels.rotate_qk: 4.2 ms
per 65,536 tokens of llama-1b's ~730 ms step, a read and a write of 40 of the 48 heads). Here the GEMM
reads the weight with its rows permuted to [all query heads | all key heads | all value heads]
(``perm_weight``: a 12.6 MB copy on llama-1b) and its epilogue rotates the query and key columns before
they are stored, so the output is already what attention reads: q [s, b, heads, d], k and v
[s, b, groups, d] as strided views, no copies.

The rotation is done on the bf16-rounded GEMM output with each product and the sum rounded to bf16, as the
model's ``apply_rotary`` in eager mode and rope_kernels do: the output is bit-identical to
``apply_rotary`` on the GEMM's bf16 output. Rows are tokens in sequence-first order (row = position *
batch + sample), so a row's position is row // batch. The rotate-half partner of column i of a head is
column i +- d/2 of the same head; with the epilogue's subtiles d columns wide (and the tile's width a
multiple of d), both sit in the same thread's registers of a Hopper accumulator, at an offset fixed when
the kernel is traced (``_partners``).

The kernel is quack's Hopper GEMM (``GemmSm90``: its mainloop, tiles and scheduler) with an epilogue
composed from quack's parts plus one operation of ours (``_RopeTables``: the cos / sin tables and each
register's coordinates). The torch expression (``gemm_rope_ref``) is the same computation, the bench's
reference. Hopper and bf16 only (``IMPORTED``: quack and cutlass-dsl load here).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

try:  # optional: quack-kernels (Hopper)
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from quack.cute_dsl_utils import get_max_active_clusters, mlir_namedtuple, torch2cute_dtype_map
    from quack.compile_utils import make_fake_tensor
    from quack.epi_ops import EpiOp
    from quack.gemm_default_epi import GemmDefaultEpiMixin
    from quack.gemm_sm90 import GemmSm90
    from quack.gemm_tvm_ffi_utils import (compile_gemm_kernel, make_fake_gemm_tensors,
                                          make_fake_scheduler_args, make_scheduler_args)
    from quack.sm90_utils import partition_for_epilogue

    class _RopeTables(EpiOp):
        """The cos / sin tables [positions, d] (gmem, read per element: 2 x 256 KB on llama-1b, in L2) and
        each epilogue register's (row, column) in the output: this thread's and, for the partner table,
        thread 0's (static when traced)."""

        def param_fields(self):
            return [("mRopeCos", object, None), ("mRopeSin", object, None)]

        def to_params(self, gemm, args):
            return {"mRopeCos": args.mRopeCos, "mRopeSin": args.mRopeSin}

        def smem_struct_field(self, gemm, params):  # (no shared memory; the struct may not be empty)
            return (f"s_{self.name}", cute.struct.Align[cute.struct.MemRange[Float32, 0], 16])

        @cute.jit
        def begin(self, gemm, param, smem_tensor, ctx):
            ident = cute.make_identity_tensor((ctx.tile_M, ctx.tile_N))
            mine = ctx.partition_for_epilogue_fn(ident)
            zero = partition_for_epilogue(ident, ctx.epi_tile, ctx.tiled_copy_r2s, 0, True)
            return [mine, zero, ctx.tile_coord_mnkl[0] * ctx.tile_M, ctx.tile_coord_mnkl[1] * ctx.tile_N]

        @cute.jit
        def begin_loop(self, gemm, state, epi_coord):
            mine, zero = (cute.group_modes(t, 3, cute.rank(t))[None, None, None, epi_coord] for t in state[:2])
            return [mine, zero, state[2], state[3]]

    class GemmRopeMixin(GemmDefaultEpiMixin):
        _epi_ops = (_RopeTables("mRope"),)
        rope_batch = 1  # set after construction (``_compiled``): samples per position (rows of a position)
        rope_cols = 0  # columns [0, rope_cols) are rotated (query and key heads), the rest stored as they are
        rope_dim = 64  # head dimension d

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            mRopeCos: cute.Tensor
            mRopeSin: cute.Tensor

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            from quack.rounding import RoundingMode
            self.rounding_mode = RoundingMode.RN
            return self.EpilogueParams(**self._epi_ops_to_params_dict(args))

        def _sm90_compute_tile_shape_or_override(self, cta_tile_shape_mnk, atom_layout_mnk, element_type=None,
                                                 epi_tile_override=None):
            """Subtiles a whole head wide, so that both halves of a rotation are in one thread's registers."""
            tile_m, _ = GemmSm90._sm90_compute_tile_shape_or_override(cta_tile_shape_mnk, atom_layout_mnk,
                                                                      element_type)
            return (tile_m, self.rope_dim)

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, tRS_rC=None):
            mine, zero, m0, n0 = epi_loop_tensors["mRope"]
            quads = _quads(zero, cute.size(tRS_rD), self.rope_dim)
            if n0 + mine[0][1] < self.rope_cols:  # the subtile is one head: rotated or not as a whole
                # every quad's cos / sin pair first (independent loads, one latency), each as one int32
                words = [cute.make_rmem_tensor(cute.make_layout(len(quads), stride=1), Int32) for _ in range(2)]
                for q in cutlass.range_constexpr(len(quads)):
                    r = quads[q][0]
                    pos = (m0 + mine[r][0]) // self.rope_batch
                    k = ((n0 + mine[r][1]) % self.rope_dim) // 2
                    words[0][q] = params.mRopeCos[pos, k]
                    words[1][q] = params.mRopeSin[pos, k]
                cos, sin = (cute.recast_tensor(w, BFloat16) for w in words)  # [c0, c1] of quad q at 2q, 2q + 1
                x = cute.make_rmem_tensor(cute.make_layout(4, stride=1), Float32)
                rot = cute.make_rmem_tensor(cute.make_layout(4, stride=1), Float32)
                cs = cute.make_rmem_tensor(cute.make_layout(4, stride=1), Float32)
                sn = cute.make_rmem_tensor(cute.make_layout(4, stride=1), Float32)
                for q in cutlass.range_constexpr(len(quads)):
                    r, p = quads[q]
                    regs = (r, r + 1, p, p + 1)  # columns c, c + 1, c + d/2, c + d/2 + 1
                    for k in cutlass.range_constexpr(4):
                        x[k] = tRS_rD[regs[k]]
                        cs[k] = cos[2 * q + k % 2].to(Float32)
                        sn[k] = sin[2 * q + k % 2].to(Float32)
                    x.store(x.load().to(BFloat16).to(Float32))  # the GEMM's output as stored in bf16
                    for k in cutlass.range_constexpr(4):  # rotate_half: [-x2, x1]
                        rot[k] = -x[k + 2] if k < 2 else x[k - 2]
                    a = (x.load() * cs.load()).to(BFloat16).to(Float32)  # each product rounded, then the sum
                    b = (rot.load() * sn.load()).to(BFloat16).to(Float32)
                    x.store((a + b).to(BFloat16).to(Float32))
                    for k in cutlass.range_constexpr(4):
                        tRS_rD[regs[k]] = x[k]
            return None

    def _quads(zero, n: int, d: int) -> list:
        """The subtile's registers as (r, p): r, r + 1 hold columns c, c + 1 of a head's first half (c even),
        p, p + 1 columns c + d/2, c + d/2 + 1 of the same row, read off thread 0's coordinates when the kernel
        is traced (every thread's registers hold the same pattern, shifted by the thread's own offset, which
        keeps a column in its half and c even)."""
        coords = [tuple(int(c) for c in zero[r]) for r in range(n)]
        where = {c: r for r, c in enumerate(coords)}
        quads = []
        for r, (m, c) in enumerate(coords):
            if c % d < d // 2 and c % 2 == 0:
                p = where[(m, c + d // 2)]
                if where.get((m, c + 1)) != r + 1 or where.get((m, c + d // 2 + 1)) != p + 1:
                    raise ValueError(f"quack_rope: register layout {coords[:8]}... has no adjacent column pairs")
                quads.append((r, p))
        if 4 * len(quads) != n:
            raise ValueError(f"quack_rope: {len(quads)} register quads for {n} registers")
        return quads

    class GemmRopeSm90(GemmRopeMixin, GemmSm90):
        pass

    IMPORTED = True
except Exception:  # noqa: BLE001 - quack / cutlass-dsl not installed, or not loadable on this machine
    IMPORTED = False


@functools.lru_cache(maxsize=None)
def _compiled(tile_mn: tuple, cluster_mn: tuple, pingpong: bool, batch: int, rope_cols: int, d: int):
    """The compiled kernel for one configuration and (batch, rotated columns, head dimension)."""
    bf16 = torch2cute_dtype_map[torch.bfloat16]
    mA, mB, mD, _, *_ = make_fake_gemm_tensors(bf16, bf16, bf16, None, "k", "k", "n", "n")
    positions = cute.sym_int()
    table = make_fake_tensor(Int32, (positions, d // 4), divisibility=4)
    epi_args = GemmRopeSm90.EpilogueArguments(table, table)

    def configure(gemm):
        gemm.rope_batch, gemm.rope_cols, gemm.rope_dim = batch, rope_cols, d
    return compile_gemm_kernel(
        GemmRopeSm90, bf16, tile_mn, (*cluster_mn, 1), pingpong, True, False, False, (9, 0),
        mA, mB, mD, None, epi_args, make_fake_scheduler_args(False, False, cute.sym_int()), None,
        post_init=configure)


class Config(NamedTuple):
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    max_swizzle_size: int = 8


def gemm_rope(x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, batch: int, rope_cols: int,
              config: Optional[Config] = None) -> Tensor:
    """``x [T, K] @ w [N, K]^T`` in bf16 with the rotate-half rotation of each d-wide head among the first
    ``rope_cols`` output columns (row t at position t // batch; cos / sin [positions, d] bf16). Hopper bf16
    only (``available``); ``gemm_rope_ref`` is the same computation in torch."""
    config = config or Config()
    d = cos.size(-1)
    if w.size(0) % config.tile_n or config.tile_n % d or rope_cols % d:
        raise ValueError(f"gemm_rope: {w.size(0)} output columns, tile {config.tile_n}, head {d}, "
                         f"{rope_cols} rotated columns: each must divide the next")
    out = x.new_empty(x.size(0), w.size(0))
    kernel = _compiled((config.tile_m, config.tile_n), (config.cluster_m, config.cluster_n), config.pingpong,
                       batch, rope_cols, d)
    clusters = get_max_active_clusters(config.cluster_m * config.cluster_n)
    views = [t.unsqueeze(0).permute(1, 2, 0) for t in (x, w, out)]  # quack's (M|N, K|N, L) views
    epi_args = GemmRopeSm90.EpilogueArguments(*(_half_pairs(t) for t in (cos, sin)))
    kernel(*views, None, epi_args, make_scheduler_args(clusters, config.max_swizzle_size, None), None, None)
    return out


def _half_pairs(table: Tensor) -> Tensor:
    """A cos / sin table [positions, d] (bf16; its two halves equal, as the model's rotate-half tables are
    built) as the kernel reads it: the first half, viewed as int32 pairs [positions, d/4]."""
    return table[:, : table.size(1) // 2].to(torch.bfloat16).contiguous().view(torch.int32)


def gemm_rope_ref(x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, batch: int, rope_cols: int) -> Tensor:
    """``gemm_rope`` as torch operations: the product rounded to x's dtype, then ``x * cos +
    rotate_half(x) * sin`` on each rotated head with every product and the sum rounded to that dtype (the
    model's ``apply_rotary`` in eager mode)."""
    y = (x.float() @ w.float().t()).to(x.dtype)
    d = cos.size(-1)
    t = y[:, :rope_cols].unflatten(1, (-1, d))  # [T, heads, d]
    pos = torch.arange(y.size(0), device=y.device) // batch
    c, s = cos.to(y.dtype)[pos][:, None], sin.to(y.dtype)[pos][:, None]
    half = torch.cat((-t[..., d // 2:], t[..., : d // 2]), dim=-1)
    return torch.cat(((t * c + half * s).flatten(1), y[:, rope_cols:]), dim=1)


def perm_weight(w: Tensor, groups: int, q_per_group: int) -> Tensor:
    """The QKV weight's rows from Megatron's grouped order (per group its query heads, its key head, its
    value head) to [all query heads | all key heads | all value heads], each part in group order (query
    head h of the result is group h // q_per_group's): one gather of whole rows."""
    return w.index_select(0, _perm_rows(groups, q_per_group, w.size(0) // (groups * (q_per_group + 2)), w.device))


@functools.lru_cache(maxsize=None)
def _perm_rows(groups: int, q_per_group: int, d: int, device) -> Tensor:
    """``perm_weight``'s row indices."""
    rows = torch.arange(groups * (q_per_group + 2) * d).view(groups, q_per_group + 2, d)
    return torch.cat((rows[:, :q_per_group].flatten(), rows[:, q_per_group].flatten(),
                      rows[:, q_per_group + 1].flatten())).to(device)
