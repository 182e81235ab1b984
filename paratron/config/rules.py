"""What every section check uses: ``need`` (a one-line ConfigError unless a condition holds), the
problems of a command line reported together, and the flags a check finds changed from their defaults."""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError


class ConfigProblems(ConfigError):
    """Several problems of one command line or config, reported together (still one line)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        text = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + " ".join(
            f"({i}) {p}" for i, p in enumerate(problems, 1))
        super().__init__(text)


def need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def changed_flags(section, prefix: str = "", names: tuple = ()) -> list[str]:
    """The flags of ``section``'s fields (those starting with ``prefix``, or named in ``names``) whose
    values differ from their defaults: what a flag that has no effect without another one checks."""
    return [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(section)
            if ((prefix and f.name.startswith(prefix)) or f.name in names) and getattr(section, f.name) != f.default]


def listed(values) -> list[str]:
    """A list flag's names; Megatron's YAML test configs write the list as one string "[layernorm mlp]":
    brackets and commas are separators."""
    return " ".join(map(str, values)).replace("[", " ").replace("]", " ").replace(",", " ").split()


def whole_numbers(values: list, flag: str) -> list[int]:
    """A list flag's words (argparse keeps them as strings) as the non-negative ints they must be."""
    need(all(str(v).isdigit() for v in values), f"{flag} takes whole numbers (got {' '.join(map(str, values))})")
    return [int(v) for v in values]
