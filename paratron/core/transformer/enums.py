"""Megatron Core's ``transformer.enums`` that a model's configuration names: ``AttnBackend``, whose member
names are --attention-backend's values."""
import enum


class AttnBackend(enum.Enum):
    """Which attention kernel trains the model (paratron: see docs/performance.md's kernel switches)."""
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
