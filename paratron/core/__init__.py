"""Megatron Core's API surface as a thin facade over paratron's explicit objects.

Code written for ``megatron.core`` ports by changing its imports to ``paratron.core``::

    from paratron.core import parallel_state, dist_checkpointing
    from paratron.core.transformer.transformer_config import TransformerConfig
    from paratron.core.models.gpt.gpt_model import GPTModel

Megatron Core keeps its process groups in module globals; paratron passes one ``ParallelDims``
explicitly to whatever needs a group. The facade bridges the two with ONE compatibility object,
:data:`paratron.core.parallel_state.COMPAT`, which ``initialize_model_parallel`` fills with the
ParallelDims (and ``model_parallel_cuda_manual_seed`` with the seed). Only modules of this package read
it; nothing below ``paratron.core`` imports it, so the library stays explicit (tests/unit/test_layering.py
checks that). docs/library.md walks through the facade and the explicit objects side by side.
"""
