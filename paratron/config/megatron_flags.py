"""Megatron-LM's flags and paratron's answer to each: the one table behind the parser, ``--help``,
docs/config.md and docs/megatron_flags.md.

Every flag of Megatron's training parser (``megatron_args.tsv``, written by
tools/dump_megatron_flags.py from Megatron-LM's ``megatron/training/arguments.py``) has one status:

* ``implemented``: a config field (paratron/config/sections.py) that the code reads;
* ``accepted``: parsed, and paratron already behaves as the flag asks (:data:`ACCEPTED` gives the
  reason; :data:`ACCEPTED_VALUES` the values that hold for a flag that takes one);
* ``refused``: a one-line error naming the flag and why (a planned feature, GPU-only, not
  applicable): :data:`REFUSED`, else the reason of its Megatron argument group or name prefix.

A name that is not a Megatron flag is an unknown flag, with a "did you mean" among paratron's flags.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .megatron_reasons import ACCEPTED, ACCEPTED_VALUES, GROUP_REASONS, HONOURED_FIELDS, PREFIX_REASONS, REFUSED
from .sections import FIELD_SECTION

ARGS_FILE = Path(__file__).with_name("megatron_args.tsv")
IMPLEMENTED, ACCEPTED_STATUS, REFUSED_STATUS = "implemented", "accepted", "refused"
PARATRON_GROUP = "paratron"  # fields that are paratron's own (no Megatron flag)


@dataclass(frozen=True)
class MegatronFlag:
    name: str  # the config/dest spelling: no_rope_fusion
    group: str  # Megatron's argument group title
    nargs: str  # "0" (a switch), "1", "+", "*" or a count

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def takes_value(self) -> bool:
        return self.nargs != "0"


@functools.lru_cache(maxsize=None)
def megatron_flags() -> dict[str, MegatronFlag]:
    """Every long flag of Megatron-LM's training parser, by config name (read once from the package)."""
    out = {}
    for line in ARGS_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            flag, group, nargs = line.split("\t")
            name = flag[2:].replace("-", "_")
            out[name] = MegatronFlag(name, group, nargs)
    return out


def megatron_version() -> str:
    """The Megatron-LM version and commit the flag list was taken from."""
    return ARGS_FILE.read_text().splitlines()[0].lstrip("# ").split(":")[0]


def canonical(name: str) -> str:
    """Megatron's ``--disable-X`` spelling of a ``--no-X`` flag (the same argument): the ``no_X`` name."""
    if name.startswith("disable_") and "no_" + name[len("disable_"):] in megatron_flags():
        return "no_" + name[len("disable_"):]
    return name


def refusal(name: str) -> Optional[str]:
    """Why paratron refuses the Megatron flag ``name`` (None when it is implemented or accepted)."""
    name = canonical(name)
    if name in FIELD_SECTION or name in ACCEPTED:
        return None
    if name in REFUSED:
        return REFUSED[name]
    for prefix, reason in PREFIX_REASONS:
        if name.startswith(prefix):
            return reason
    group = megatron_flags()[name].group if name in megatron_flags() else None
    return GROUP_REASONS.get(group, "not implemented in paratron (no plan yet); remove the flag")


# Megatron's negative switches: --no-X sets the (default-on) field X to false.
NEGATED_FLAGS = {"no_check_for_nan_in_loss_and_grad": "check_for_nan_in_loss_and_grad",
                 "no_yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
                 "muon_no_split_qkv": "muon_split_qkv"}


def status(name: str) -> tuple[str, str]:
    """(status, reason) of a Megatron flag; the reason of an implemented flag is its help line."""
    from .help import field_help
    if canonical(name) != name:
        st, reason = status(canonical(name))
        return st, f"= --{canonical(name).replace('_', '-')}: {reason}"
    if name in NEGATED_FLAGS:
        return IMPLEMENTED, f"= {'--' + NEGATED_FLAGS[name].replace('_', '-')} false"
    if name in HONOURED_FIELDS:
        return ACCEPTED_STATUS, HONOURED_FIELDS[name]
    if name in FIELD_SECTION:
        return IMPLEMENTED, field_help(name)
    if name in ACCEPTED:
        return ACCEPTED_STATUS, ACCEPTED[name]
    return REFUSED_STATUS, refusal(name)


def group_of(name: str) -> str:
    """Megatron's argument group of a flag (paratron's own flags: ``paratron``)."""
    flags = megatron_flags()
    return flags[name].group if name in flags else PARATRON_GROUP


def value_problem(name: str, values: list[str]) -> Optional[str]:
    """A one-line problem when an accepted flag is given a value paratron does not honour."""
    allowed = ACCEPTED_VALUES.get(name)
    if allowed is None:
        return None
    bad = [v for v in values if v not in allowed]
    if not bad:
        return None
    flag = "--" + name.replace("_", "-")
    return f"{flag} {bad[0]}: paratron honours only {' | '.join(allowed)} ({ACCEPTED[name]})"
