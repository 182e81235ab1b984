"""Megatron Core's ``pipeline_parallel``: get_forward_backward_func over paratron's schedules."""
from .schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
