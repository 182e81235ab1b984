"""quack's CuTe-DSL GEMMs with a chosen tile configuration, as torch custom ops (Hopper, bf16 training).

quack (https://github.com/Dao-AILab/quack) picks a tile configuration by autotuning (``tuned=True``, a
sweep at first use of each shape) or takes a default one (``tuned=False``: 128x192 tiles, cluster 2x1,
ping-pong). At the H100's power limit, where the training step runs, the default is not the best
for every GEMM of the step (benchmarks/results/gemm_power_20261126_0915.md), and cuBLAS cannot do two of them
without an extra pass:

- ``residual``: ``out = C + A @ B`` with ``out`` a new tensor. torch's ``addmm`` copies C into ``out``
  before the GEMM accumulates into it (a device-to-device copy of the residual stream before every
  output projection and fc2 GEMM, two per layer and micro-batch on llama-1b,
  benchmarks/results/profile_origins_20261126_0906.txt). quack's epilogue reads C and writes ``out``.
  At the cap, the output projection (K 2048) on quack's default tiles is faster than addmm with its copy;
  fc2 (K 8192) is slower at quack's best tiles (benchmarks/results/gemm_power_residual_20261126_1213.md):
  so quack takes it up to ``RESIDUAL_MAX_K`` only. Off by default since cuBLASLt does the same without the
  copy and is faster than quack at both shapes (cublaslt.py;
  benchmarks/results/gemm_power_residual_20261126_1633.md): ``residual=default`` brings quack back.
- ``dgated``: fc2's input gradient with SwiGLU's backward in the epilogue (kernels/quack_mlp.py; without
  the activation's store, quack_dgated.py): 128x160 ping-pong is the fastest of the measured tiles, ahead of
  128x128 and the default 128x192, with the store and without it
  (benchmarks/results/backward_levers_20261126_1400.md).
- ``wgrad_fc1`` / ``wgrad_fc2``: the gated MLP's weight gradients added into the fp32 ``main_grad`` by
  quack's epilogue (a TMA reduce-add; fc1's in the [gate; up] row order, ``concat_layout``): fc1 at
  256x128 cluster 1x2 slightly faster than cuBLAS's bf16 product + the de-interleaving add; fc2 at
  128x256 cluster 2x1 faster than cuBLAS accumulating in place. The QKV shape stays on cuBLAS (quack's best
  there is only marginally faster, at tiles that lose elsewhere: not worth a choice)
  (benchmarks/results/backward_levers_20261126_1400.md).
- ``dx``: fc1's input gradient reading its weight in the interleaved [g0, u0, ...] row order in place
  (no re-ordering copy of the weight per micro-batch), at 256x128, cluster 1x2: in the step the GEMM takes
  the same time as cuBLAS's and the copy is gone, so the GPU is busy for less time per step (two profiles
  of one command, default and dx:
  benchmarks/results/profile_kernels_llama-1b_mb16x2_7e718b0_{default,dx}.tsv).

``--kernel-quack-tiles`` overrides the configuration of the gated MLP's uses, e.g. ``dgated=128x192c2x1pp``
(``off``: the torch / cuBLAS path; ``default``: quack's default tiles); the defaults below are the
configurations measured best at the power cap (the records above; the probe that timed them is kept in the
git history, benchmarks/README.md, and benchmarks/matmul_shapes.py --quack times quack's GEMM beside cuBLAS).
The residual GEMM keeps its default (off: measured no faster than cuBLASLt).
The ops run torch expressions on CPUs (the tests) and wherever
quack cannot run.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config.kernels import tile_fields

try:  # optional: pip install quack-kernels (Hopper); used only on CUDA
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_dgated_tuned as _dgated_tuned, gemm_tuned as _gemm_tuned
    _gemm_raw = getattr(_gemm_tuned, "fn", _gemm_tuned)  # the kernel without the autotuner around it
    _dgated_raw = getattr(_dgated_tuned, "fn", _dgated_tuned)
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    GemmConfig = _gemm_raw = _dgated_raw = None

# tile_m x tile_n, cluster m x n, ping-pong (pp) or cooperative (coop); measured at the power cap (records in the
# module's docstring)
TILES = {"residual": "off", "dgated": "128x160c2x1pp", "dx": "256x128c1x2coop", "wgrad_fc1": "256x128c1x2coop",
         "wgrad_fc2": "128x256c2x1coop"}
RESIDUAL_MAX_K = 2048  # the residual GEMM goes to quack up to this inner dimension (measured above)


def parse(spec: str) -> Optional[dict]:
    """GemmConfig fields from "256x128c1x2coop" / "128x128c2x1pp"; None for "default" and "off"."""
    if spec in ("default", "off"):
        return None
    fields = tile_fields(spec)  # the config's parser (--kernel-quack-tiles): one definition of the format
    if fields is None:
        raise ValueError(f"quack tiles: '{spec}' is not default, off or tiles like 256x128c1x2coop "
                         "or 128x128c2x1pp")
    return fields


def tiles(overrides: Optional[dict] = None) -> dict:
    """TILES with the ``{use: tiles}`` of ``--kernel-quack-tiles`` (parsed by the config), each value checked."""
    out = dict(TILES)
    for name, value in (overrides or {}).items():
        if name not in TILES:
            raise ValueError(f"quack tiles: no GEMM use '{name}' (one of {', '.join(TILES)})")
        parse(value)
        out[name] = value
    return out


def tile(name: str, chosen: Optional[dict] = None) -> str:
    """The configuration string of use ``name`` ("off", "default" or tiles) in ``chosen`` (a ``tiles()``
    answer; None: the defaults)."""
    return (chosen or TILES)[name]


def config(spec: str):
    """quack's GemmConfig for ``spec``; None (quack's default tiles) for "default"."""
    fields = parse(spec)
    return None if fields is None else GemmConfig(**fields)


def _runs_here(t: Tensor) -> bool:
    """quack's Hopper kernels can run on ``t``'s device (bf16, compute capability 9)."""
    return (_gemm_raw is not None and t.is_cuda and t.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def residual_applies(x: Tensor) -> bool:
    """Whether ``gemm_add`` should replace torch's addmm for the left operand ``x``: a CUDA bf16 tensor
    with an inner dimension up to RESIDUAL_MAX_K, quack importable and the ``residual`` use not off (the
    op itself falls back where the GPU is not Hopper)."""
    return (_gemm_raw is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.size(-1) <= RESIDUAL_MAX_K
            and TILES["residual"] != "off")


@torch.library.custom_op("paratron::quack_gemm_add", mutates_args=())
def gemm_add(c: Tensor, a: Tensor, w: Tensor, spec: str) -> Tensor:
    """``c + a @ w^T`` (``a`` [M, K], ``w`` [N, K], ``c`` [M, N]) into a new tensor: quack's GEMM reading
    C in its epilogue with the tiles ``spec``; torch's addmm where quack cannot run."""
    if not _runs_here(a) or spec == "off":
        return torch.addmm(c, a, w.t())
    out = torch.empty(a.size(0), w.size(0), dtype=a.dtype, device=a.device)
    _gemm_raw(a, w.t(), out, C=c, config=config(spec))
    return out


@gemm_add.register_fake
def _gemm_add_fake(c, a, w, spec):
    return a.new_empty(a.size(0), w.size(0))


@torch.library.custom_op("paratron::quack_gemm_interleaved", mutates_args=())
def gemm_interleaved(a: Tensor, w: Tensor, spec: str) -> Tensor:
    """``a @ interleave(w)`` (``a`` [M, 2F] with interleaved columns, ``w`` [2F, K] in [gate; up] rows):
    quack reads ``w``'s rows in the interleaved order in place (``concat_layout``); CUDA only."""
    out = torch.empty(a.size(0), w.size(1), dtype=a.dtype, device=a.device)
    _gemm_raw(a, w, out, config=config(spec), concat_layout=("B",), dynamic_scheduler=True)
    return out


@gemm_interleaved.register_fake
def _gemm_interleaved_fake(a, w, spec):
    return a.new_empty(a.size(0), w.size(1))


@torch.library.custom_op("paratron::quack_gemm_dgated", mutates_args=())
def gemm_dgated(dy: Tensor, w2: Tensor, pre: Tensor, spec: str) -> tuple[Tensor, Tensor]:
    """(d pre-activation [M, 2F] interleaved, SwiGLU activation [M, F]) from ``dy @ w2`` and the kept
    pre-activation: quack's gemm_dgated with the tiles ``spec``; CUDA only."""
    dpre = torch.empty_like(pre)
    act = torch.empty(pre.size(0), pre.size(1) // 2, dtype=pre.dtype, device=pre.device)
    _dgated_raw(dy, w2, pre, dpre, act, activation="swiglu", config=config(spec))
    return dpre, act


@gemm_dgated.register_fake
def _gemm_dgated_fake(dy, w2, pre, spec):
    return torch.empty_like(pre), pre.new_empty(pre.size(0), pre.size(1) // 2)


def accumulate_applies(main_grad: Tensor, dy: Tensor, spec: str) -> bool:
    """Whether ``gemm_accumulate`` can add into ``main_grad``: quack runs on ``dy``, a contiguous fp32
    buffer, the use not off."""
    return spec != "off" and _runs_here(dy) and main_grad.dtype == torch.float32 and main_grad.is_contiguous()


@torch.library.custom_op("paratron::quack_gemm_accumulate", mutates_args=("main_grad",))
def gemm_accumulate(main_grad: Tensor, dy: Tensor, x: Tensor, interleaved: bool, spec: str) -> None:
    """``main_grad += dy^T @ x`` by quack's GEMM adding its fp32 result into the buffer (TMA reduce-add);
    ``interleaved``: ``dy``'s columns are the gated MLP's [g0, u0, ...] order and the rows go to
    ``main_grad``'s [gate; up] halves. CUDA (Hopper) only: see ``accumulate_applies``."""
    _gemm_raw(dy.t(), x, main_grad, None, add_to_output=True, config=config(spec),
              concat_layout=("out",) if interleaved else None)


@gemm_accumulate.register_fake
def _gemm_accumulate_fake(main_grad, dy, x, interleaved, spec):
    return None
