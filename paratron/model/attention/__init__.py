"""Self-attention and its cores, one module per execution path, chosen when the layer is built:

* ``sdpa.py``: torch SDPA, and the frame every core shares (layout, KV cache, recomputation);
* ``flash.py``: FlashAttention-4 (Hopper, bf16), with the rotary embedding inside the op where it can;
* ``windowed.py``: sliding windows and attention sinks on SDPA (--window-size, --softmax-type);
* ``context_parallel.py``: across the context-parallel ranks (ring / all-to-all), with window and sinks;
* ``decode.py``: one-token steps over the inference KV cache with grouped heads;
* ``self_attention.py``: ``Attention`` (projections -> q / k norms -> rotary -> core -> gate -> output
  projection) and ``build_core``, the choice.
"""
from .context_parallel import ContextParallelAttention
from .decode import SMALL_DECODE_BATCH, GroupedDecode
from .flash import FlashAttention
from .sdpa import SDPAttention
from .self_attention import Attention, build_core, rotation_of
from .windowed import (SOFTMAX_TYPES, CoreAttention, WindowedAttention, layer_pattern, needs_core_attention,
                       parse_window_size, rope_layers, window_layers)

__all__ = ["Attention", "build_core", "rotation_of", "SDPAttention", "FlashAttention", "WindowedAttention",
           "CoreAttention", "ContextParallelAttention", "GroupedDecode", "SMALL_DECODE_BATCH", "SOFTMAX_TYPES",
           "layer_pattern", "needs_core_attention", "parse_window_size", "rope_layers", "window_layers"]
