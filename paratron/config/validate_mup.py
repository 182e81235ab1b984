"""Checks of the muP flags (paratron/model/mup.py), called from validate.py."""
from __future__ import annotations

from .sections import ModelConfig
from .validate_sched import changed_flags, need


def validate_mup(m: ModelConfig) -> None:
    """--mup-* only with --use-mup; a given --mup-width-mult must be --hidden-size / --mup-base-hidden-size
    (Megatron computes it); not with multi-latent attention (its softmax scale is YaRN's mscale)."""
    from ..model import mup
    if not m.use_mup:
        given = changed_flags(m, prefix="mup_")
        need(not given, f"{', '.join(given)}: no effect without --use-mup; add it or remove them")
        return
    base = m.mup_base_hidden_size or m.hidden_size
    need(m.mup_width_mult in (1.0, m.hidden_size / base), f"--mup-width-mult {m.mup_width_mult} is computed as "
         f"--hidden-size / --mup-base-hidden-size = {m.hidden_size / base:g}; remove it or give the base size instead")
    need(not m.multi_latent_attention, "--use-mup with --multi-latent-attention: MLA's softmax scale (YaRN's "
         "mscale) under muP is not implemented; remove one of them")
    mup.resolve(m)
