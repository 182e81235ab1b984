"""Megatron Core's ``tensor_parallel``: the seeding entry point (the parallel layers are paratron's,
``paratron.parallel.tensor``)."""
from .random import model_parallel_cuda_manual_seed

__all__ = ["model_parallel_cuda_manual_seed"]
