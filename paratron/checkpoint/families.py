"""The Hugging Face model families ``paratron convert`` writes and reads, and its error: names only (no torch), so
that ``paratron convert --help`` answers at once; the conversions are hf_config.py's, hf_moe.py's and
hf_hybrid.py's."""
from __future__ import annotations

from ..errors import UserError

MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
HYBRID_FAMILIES = ("mamba2", "nemotron_h", "qwen3_next")
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3") + MOE_FAMILIES + ("deepseek_v3",) + HYBRID_FAMILIES


class ConversionError(UserError, ValueError):
    """The checkpoint or config cannot be converted; the message is one line naming what and why."""
