"""Transformer pieces: the forward context, norms, rotary embedding, MLP and attention, importable from here.

Activations are laid out [sequence, batch, hidden] (Megatron's layout: sequence parallelism splits
dimension 0). Parallel plumbing is confined to the parallel linear layers; at TP=1 this is a plain
transformer. Each piece lives in its own module: context.py (``Parallel``, ``ForwardContext``), norms.py,
rotary.py, mlp.py, attention/ (self-attention and its cores).
"""
from ..kernels.rotary import apply_rotary
from .attention import Attention
from .context import ForwardContext, Parallel
from .mlp import MLP, latent_projections, output_init
from .norms import Norm
from .rotary import Rotary, apply_rotary_interleaved, rope_inv_freq

__all__ = ["Attention", "ForwardContext", "MLP", "Norm", "Parallel", "Rotary", "apply_rotary",
           "apply_rotary_interleaved", "latent_projections", "output_init", "rope_inv_freq"]
