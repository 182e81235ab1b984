"""How the decoder's layers split over (virtual) pipeline stages, as the config gives it: Megatron's
``--pipeline-model-parallel-layout`` (which layers each stage holds), the equal or
``--decoder-first/last-pipeline-num-layers`` split, and the virtual size (paratron/parallel/stages.py
builds the model chunks from these).

The string lists the stages separated by ``|``; each stage is a run of layer letters: ``E`` the
embedding, ``t`` a transformer layer, ``L`` the loss (final norm, output layer), ``m`` an MTP layer.
``x*n`` repeats one letter, ``(...)*n`` repeats a group (groups do not nest), commas are only for
reading: ``"Et*3|(tt|)*2,tL"`` is the stages ``Ettt``, ``tt``, ``tt``, ``tL``. There are PP x V
stages: stage ``s`` is virtual stage ``s // PP`` of pipeline rank ``s % PP`` (Megatron's order, the
one of stage_layer_counts and chunk_layers below), and layers are numbered in stage order.

paratron's embedding lives on the first stage and its loss on the last one, so ``E`` must open the
first stage and ``L`` close the last; a stage may hold no transformer layer (an embedding-only or
loss-only stage). MTP layers (``m``) are refused by name: paratron runs multi-token prediction at
pipeline size 1 only.
"""
from __future__ import annotations

import re
from typing import Optional

from ..errors import ConfigError

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


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> list[int]:
    """Number of decoder layers on each of the ``pp`` stages."""
    if pp == 1:
        if first is not None or last is not None:
            raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers]
    fixed = {0: first, pp - 1: last}
    for stage, n in fixed.items():
        if n is not None and n < 0:
            which = "first" if stage == 0 else "last"
            raise ConfigError(f"--decoder-{which}-pipeline-num-layers must be >= 0 (got {n})")
    rest = num_layers - sum(n for n in fixed.values() if n is not None)
    free = [s for s in range(pp) if fixed.get(s) is None]
    if rest < 0:
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) add up to more than "
                          f"--num-layers {num_layers}")
    if not free:
        if rest:
            raise ConfigError(f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers "
                              f"{last} must equal --num-layers {num_layers} with 2 pipeline stages")
        return [first, last]
    if rest % len(free):
        if len(free) == pp:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                              "change one, or split unevenly with --decoder-first/last-pipeline-num-layers")
        raise ConfigError(f"the {rest} layers left by --decoder-first/last-pipeline-num-layers do not split evenly "
                          f"over the other {len(free)} pipeline stages")
    return [fixed.get(s) if fixed.get(s) is not None else rest // len(free) for s in range(pp)]


def chunk_layers(num_layers: int, pp: int, vpp: Optional[int] = None, first: Optional[int] = None,
                 last: Optional[int] = None, layout: Optional[str] = None) -> dict[tuple[int, int], tuple[int, int]]:
    """{(virtual index v, pipeline rank r): (first global layer, number of layers)} of every chunk.
    ``layout``: a --pipeline-model-parallel-layout string, which fixes every chunk's count."""
    v_size = vpp or 1
    if layout is not None:
        per_chunk = layout_counts(layout, num_layers, pp)
    else:
        counts = stage_layer_counts(num_layers, pp, first, last)
        if v_size > 1 and any(n % v_size for n in counts):
            raise ConfigError(f"with --virtual-pipeline-model-parallel-size {v_size} every stage's layer count must "
                              f"be divisible by {v_size}; the stages have {counts} layers")
        per_chunk = {(v, r): counts[r] // v_size for v in range(v_size) for r in range(pp)}
    out, offset = {}, 0
    for v in range(v_size):
        for r in range(pp):
            out[(v, r)] = (offset, per_chunk[(v, r)])
            offset += per_chunk[(v, r)]
    return out


def _virtual_size_of_layout(par) -> Optional[int]:
    """The virtual size --pipeline-model-parallel-layout or --num-virtual-stages-per-pipeline-rank gives
    (at most one of them and --num-layers-per-virtual-pipeline-stage, as Megatron); None: neither."""
    given = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", par.num_layers_per_virtual_pipeline_stage),
                            ("--num-virtual-stages-per-pipeline-rank", par.num_virtual_stages_per_pipeline_rank),
                            ("--pipeline-model-parallel-layout", par.pipeline_model_parallel_layout)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} are mutually exclusive; choose one")
    if par.pipeline_model_parallel_layout is not None:
        if par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None:
            raise ConfigError("--pipeline-model-parallel-layout fixes every stage's layers: remove "
                              "--decoder-first/last-pipeline-num-layers")
        stages = num_stages(par.pipeline_model_parallel_layout)
        if stages % par.pipeline_model_parallel_size:
            raise ConfigError(f"--pipeline-model-parallel-layout has {stages} stages, not a multiple of "
                              f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size}")
        return stages // par.pipeline_model_parallel_size
    return par.num_virtual_stages_per_pipeline_rank


def accounted_layout(par, num_layers: int) -> Optional[str]:
    """The layout of Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding (loss)
    counts as one layer of the first (last) virtual stage, and the layers plus those split evenly over
    the PP x V stages; None without either flag."""
    extra = [f for f, on in (("--account-for-embedding-in-pipeline-split", par.account_for_embedding_in_pipeline_split),
                             ("--account-for-loss-in-pipeline-split", par.account_for_loss_in_pipeline_split)) if on]
    if not extra:
        return None
    pp = par.pipeline_model_parallel_size
    if pp == 1:
        raise ConfigError(f"{extra[0]} has no effect without --pipeline-model-parallel-size > 1; remove it")
    given = [f for f, v in (("--pipeline-model-parallel-layout", par.pipeline_model_parallel_layout),
                            ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers),
                            ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers),
                            ("--num-layers-per-virtual-pipeline-stage", par.num_layers_per_virtual_pipeline_stage))
             if v is not None]
    if given:
        raise ConfigError(f"{extra[0]} and {given[0]} both say how layers split over stages; choose one")
    stages = pp * (par.virtual_pipeline_model_parallel_size or par.num_virtual_stages_per_pipeline_rank or 1)
    e, loss = int(par.account_for_embedding_in_pipeline_split), int(par.account_for_loss_in_pipeline_split)
    if (num_layers + e + loss) % stages:
        raise ConfigError(f"{' and '.join(extra)}: --num-layers {num_layers} + {e + loss} must be divisible by the "
                          f"{stages} (virtual) pipeline stages")
    k = (num_layers + e + loss) // stages
    counts = [k - (e if s == 0 else 0) - (loss if s == stages - 1 else 0) for s in range(stages)]
    return "|".join(("E" if s == 0 else "") + "t" * n + ("L" if s == stages - 1 else "") for s, n in enumerate(counts))


def finalize_pipeline(par, num_layers: int) -> Optional[int]:
    """Config checks of the pipeline layout (called by resolve): checks that the layers split and
    returns the virtual pipeline size (derived from ``--num-layers-per-virtual-pipeline-stage`` when given).
    Megatron's --account-for-*-in-pipeline-split become the layout they imply (``accounted_layout``)."""
    layout = accounted_layout(par, num_layers)
    if layout is not None:
        par.pipeline_model_parallel_layout, par.num_virtual_stages_per_pipeline_rank = layout, None
    pp = par.pipeline_model_parallel_size
    per_v = par.num_layers_per_virtual_pipeline_stage
    vpp = par.virtual_pipeline_model_parallel_size
    derived = _virtual_size_of_layout(par)
    if derived is not None:
        if vpp is not None and vpp != derived:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp} contradicts the {derived} virtual stages "
                              "per rank of --num-virtual-stages-per-pipeline-rank / --pipeline-model-parallel-layout")
        vpp = derived
    if per_v is not None:
        if per_v < 1 or num_layers % pp or (num_layers // pp) % per_v:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_v} must divide the {num_layers} / {pp} "
                              "layers of each pipeline stage")
        derived = num_layers // pp // per_v
        if vpp is not None and vpp != derived:
            raise ConfigError("--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage "
                              "are mutually exclusive; choose one")
        vpp = derived
    if vpp is not None:
        if vpp < 1:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1 (got {vpp})")
        if vpp > 1 and pp == 1:
            raise ConfigError("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1")
    chunk_layers(num_layers, pp, vpp, par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                 par.pipeline_model_parallel_layout)
    return vpp
