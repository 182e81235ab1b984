"""fc2's input gradient with SwiGLU's backward in the epilogue, without writing the activation again.

quack's ``gemm_dgated`` (the gated MLP's backward, kernels/quack_mlp.py) writes three things from each output
tile: d[gate, up] and the SwiGLU activation recomputed from the kept pre-activation, which fc2's weight
gradient needs. When the forward's activation is kept instead (it is fc2's input: the forward writes it
anyway), the second write is one of the epilogue's five [tokens, F]-wide bf16 transfers (it reads the
[tokens, 2F] pre-activation and writes its [tokens, 2F] gradient besides). ``GemmDGatedKeepSm90`` is quack's
Hopper kernel with that store taken out of its epilogue: the same operations on the accumulator, the same
d[gate, up] bit for bit, one output fewer.

Only the epilogue's composition changes (quack builds a kernel's epilogue from a list of operations,
``_epi_ops``; the activation's store is one of them): the mainloop, tiles and scheduler are quack's. The
kernel is compiled once per tile configuration and operand layout (CuTe DSL, at first use) and cached.
(Measured and not kept, both slower: loading 4 pre-activation subtiles ahead instead of quack's 2,
benchmarks/results/backward_levers_20261126_1440.md; and other epilogue subtiles,
benchmarks/results/backward_levers_20261126_1525.md.)
Hopper (compute capability 9.0) and bf16 only; ``available()`` says whether it can run here.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

try:  # optional: quack-kernels (Hopper)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from quack.activation import dgate_fn_map
    from quack.cute_dsl_utils import get_max_active_clusters, mlir_namedtuple, torch2cute_dtype_map
    from quack.gemm_dact import GemmDGatedMixin
    from quack.gemm_default_epi import GemmDefaultEpiMixin
    from quack.gemm_sm90 import GemmSm90
    from quack.gemm_tvm_ffi_utils import (compile_gemm_kernel, get_major, make_fake_gemm_tensors,
                                          make_fake_scheduler_args, make_scheduler_args)
    from quack.rounding import RoundingMode

    class _KeepActMixin(GemmDGatedMixin):
        """GemmDGatedMixin's epilogue minus the activation's tile store (and its shared memory)."""
        _epi_ops = tuple(op for op in GemmDGatedMixin._epi_ops if op.name != "mPostAct")

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            act_bwd_fn: cutlass.Constexpr[Callable] = None
            alpha: Optional[Float32 | cute.Tensor] = None
            beta: Optional[Float32 | cute.Tensor] = None
            mRowVecBroadcast: Optional[cute.Tensor] = None
            mColVecBroadcast: Optional[cute.Tensor] = None
            mColVecReduce: Optional[cute.Tensor] = None
            rounding_mode: cutlass.Constexpr[int] = RoundingMode.RN
            sr_seed: Optional[Int32 | cute.Tensor] = None

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            assert self.implicit_dtype.width == 16 and self.d_dtype.width == 32 and self.c_dtype.width == 32
            self.rounding_mode = args.rounding_mode
            params = self._epi_ops_to_params_dict(args)
            params["act_bwd_fn"] = args.act_bwd_fn
            return self.EpilogueParams(**params)

        # no activation output: the default epilogue's hooks (the kernel then skips its store)
        epi_setup_postact = GemmDefaultEpiMixin.epi_setup_postact
        epi_convert_postact = GemmDefaultEpiMixin.epi_convert_postact

    class GemmDGatedKeepSm90(_KeepActMixin, GemmSm90):
        pass

    IMPORTED = True
except Exception:  # noqa: BLE001 - quack / cutlass-dsl not installed, or not loadable on this machine
    IMPORTED = False


def available(t: Tensor) -> bool:
    """The kernel can run on ``t``: quack importable, a bf16 tensor on a compute-capability-9 GPU."""
    return (IMPORTED and t.is_cuda and t.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(t.device)[0] == 9)


@functools.lru_cache(maxsize=None)
def _compiled(tile_mn: tuple, cluster_mn: tuple, pingpong: bool, a_major: str, b_major: str):
    """The compiled kernel for one configuration (d[gate, up] and the pre-activation n-major)."""
    bf16 = torch2cute_dtype_map[torch.bfloat16]
    mA, mB, mD, mC, *_ = make_fake_gemm_tensors(bf16, bf16, Float32, Float32, a_major, b_major, "n", "n")
    epi_args = GemmDGatedKeepSm90.EpilogueArguments(dgate_fn_map["swiglu"])

    def set_implicit_dtype(gemm):
        gemm.implicit_dtype = bf16
    return compile_gemm_kernel(
        GemmDGatedKeepSm90, bf16, tile_mn, (*cluster_mn, 1), pingpong, True, False, True, (9, 0),
        mA, mB, mD, mC, epi_args, make_fake_scheduler_args(True, False, cute.sym_int()), None,
        post_init=set_implicit_dtype)


def gemm_dgated_keep(dy: Tensor, w2: Tensor, pre: Tensor, config) -> Tensor:
    """d pre-activation [M, 2F] (interleaved [g0, u0, ...], like ``pre``) of the SwiGLU MLP from fc2's
    output gradient ``dy`` [M, H], fc2's weight ``w2`` [H, F] and the kept pre-activation; ``config``: a
    quack GemmConfig (tiles, cluster, ping-pong; the scheduler is always the dynamic persistent one, as
    quack's own dgated runs it) or None for quack's default. Hopper bf16 only."""
    if config is None:
        from quack.gemm_interface import default_config
        config = default_config(dy.device)
    dpre = torch.empty_like(pre)
    # quack's (M, N, L) views: A (M, K, 1), B (N, K, 1), D and C as fp32 pairs (M, F, 1)
    a = dy.unsqueeze(0).permute(1, 2, 0)
    b = w2.mT.unsqueeze(0).permute(1, 2, 0)
    d = dpre.view(torch.float32).unsqueeze(0).permute(1, 2, 0)
    c = pre.view(torch.float32).unsqueeze(0).permute(1, 2, 0)
    kernel = _compiled((config.tile_m, config.tile_n), (config.cluster_m, config.cluster_n), config.pingpong,
                       get_major(a, "m", "k"), get_major(b, "n", "k"))
    semaphore = torch.zeros(1, dtype=torch.int32, device=dy.device)
    clusters = get_max_active_clusters(config.cluster_m * config.cluster_n)
    epi_args = GemmDGatedKeepSm90.EpilogueArguments(None, rounding_mode=None, sr_seed=None)
    kernel(a, b, d, c, epi_args, make_scheduler_args(clusters, config.max_swizzle_size, semaphore), None, None)
    return dpre


@torch.library.custom_op("paratron::quack_gemm_dgated_keep", mutates_args=())
def dgated_keep(dy: Tensor, w2: Tensor, pre: Tensor, spec: str) -> Tensor:
    """``gemm_dgated_keep`` with the tiles ``spec`` (quack_gemm.py's strings) as one opaque op for
    compiled backwards. CUDA (Hopper, bf16) only: see ``available``."""
    from .. import quack_gemm
    return gemm_dgated_keep(dy, w2, pre, quack_gemm.config(spec))


@dgated_keep.register_fake
def _dgated_keep_fake(dy, w2, pre, spec):
    return torch.empty_like(pre)
