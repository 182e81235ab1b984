"""Megatron's ``--pipeline-model-parallel-layout``: which layers each (virtual) pipeline stage holds.

The string lists the stages separated by ``|``; each stage is a run of layer letters: ``E`` the
embedding, ``t`` a transformer layer, ``L`` the loss (final norm, output layer), ``m`` an MTP layer.
``x*n`` repeats one letter, ``(...)*n`` repeats a group (groups do not nest), commas are only for
reading: ``"Et*3|(tt|)*2,tL"`` is the stages ``Ettt``, ``tt``, ``tt``, ``tL``. There are PP x V
stages: stage ``s`` is virtual stage ``s // PP`` of pipeline rank ``s % PP`` (Megatron's order, the
one of paratron/parallel/stages.py), and layers are numbered in stage order.

paratron's embedding lives on the first stage and its loss on the last one, so ``E`` must open the
first stage and ``L`` close the last; a stage may hold no transformer layer (an embedding-only or
loss-only stage). MTP layers (``m``) are refused by name: paratron runs multi-token prediction at
pipeline size 1 only.
"""
from __future__ import annotations

import re

from ..config import ConfigError

LETTERS = {"E": "embedding", "t": "transformer layer", "L": "loss", "m": "MTP layer"}
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_LETTER = re.compile(r"(.)\*(\d+)")


def expand(layout: str) -> list[str]:
    """The stages of ``layout`` as strings of letters (repeats unrolled, commas dropped): Megatron's
    reading, groups first, then single letters."""
    text = layout.replace(",", "")
    text = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _LETTER.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        for ch in stage:
            if ch not in LETTERS:
                raise ConfigError(f"--pipeline-model-parallel-layout {layout!r}: unknown layer letter {ch!r}; "
                                  "use E (embedding), t (transformer layer), L (loss), | between stages")
    return stages


def num_stages(layout: str) -> int:
    return len(expand(layout))


def layout_counts(layout: str, num_layers: int, pp: int) -> dict[tuple[int, int], int]:
    """{(virtual index v, pipeline rank r): transformer layers} of ``layout``, checked against
    ``--num-layers`` and the pipeline size (one-line ConfigErrors naming what is wrong)."""
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    stages = expand(layout)
    if "m" in "".join(stages):
        raise ConfigError(f"{flag}: MTP layers ('m') are not supported: paratron runs --mtp-num-layers "
                          "without pipeline parallelism only; remove them from the layout")
    if len(stages) % pp:
        raise ConfigError(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}")
    flat = "".join(stages)
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(f"{flag}: the layout needs exactly one E (embedding) and one L (loss)")
    if not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise ConfigError(f"{flag}: E must open the first stage and L close the last one (paratron keeps the "
                          "embedding on the first stage and the loss on the last)")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{flag} places {flat.count('t')} transformer layers but --num-layers is {num_layers}")
    return {(s // pp, s % pp): stage.count("t") for s, stage in enumerate(stages)}
