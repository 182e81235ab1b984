"""paratron: GPT training with Megatron-LM parallelism, flags and data, in a small codebase."""

__version__ = "0.1.0"
