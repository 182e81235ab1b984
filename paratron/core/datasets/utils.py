"""Megatron Core's ``datasets.utils``: ``compile_helpers`` has nothing to compile (paratron's sample
indices are numpy, paratron/data/indices.py)."""


def compile_helpers() -> None:
    """Megatron compiles its C++ index helpers here; paratron has none."""
