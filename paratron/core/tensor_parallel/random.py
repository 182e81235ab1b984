"""Megatron Core's ``model_parallel_cuda_manual_seed``: seeds python, numpy and torch (CPU and CUDA) with
``seed + 100 x pipeline rank`` (paratron.parallel.random.set_seed) and keeps ``seed`` for the facade's
GPTModel, which draws its initial weights and its tensor-parallel dropout stream from it (paratron's
models own their RNG tracker: nothing global is forked here)."""
from __future__ import annotations

from ...parallel.random import set_seed
from ..parallel_state import COMPAT


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, **_ranks) -> None:
    """Megatron's signature (the tracker options change nothing here: paratron has one kind of tracker)."""
    pp_rank = COMPAT.dims.pp_rank if COMPAT.dims is not None else 0
    set_seed(int(seed), pp_rank)
    COMPAT.seed = int(seed)
