"""Building a Config: YAML files and presets, then command-line flags (Megatron's names), then
``resolve()``. The tokenizer flags are defined here once, for ``paratron train`` and ``paratron
preprocess`` alike."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from ..errors import ArgumentParser, ConfigError, UserError
from .help import field_help
from .megatron_flags import NEGATED_FLAGS, canonical, group_of, megatron_flags, refusal, value_problem
from .megatron_reasons import ACCEPTED, REFUSED, RETIRED
from .sections import FIELD_SECTION, FIELD_TYPES, SECTIONS, TOKENIZER_FIELDS, Config, DataConfig, base_type, flag
from .check_data import validate_tokenizer
from .resolution import resolve as resolve_config
from .rules import ConfigProblems

# The Megatron flags that are not config fields: accepted (paratron already does what they ask) or
# refused by name, with the reason (paratron/config/megatron_reasons.py).
ACCEPTED_NO_OP_FLAGS = frozenset(ACCEPTED)
UNSUPPORTED_MEGATRON_FLAGS = frozenset(REFUSED)

# Megatron's spellings that flag() does not produce, as extra option strings of the field's flag.
FLAG_ALIASES = {"override_opt_param_scheduler": ["--override-opt_param-scheduler"],
                "use_checkpoint_opt_param_scheduler": ["--use-checkpoint-opt_param-scheduler"]}



def _coerce(name: str, value: Any) -> Any:
    """Check and convert a YAML value to the field's type."""
    tp = base_type(FIELD_TYPES[name])
    if value is None:
        return None
    if tp is int and isinstance(value, float) and not value.is_integer():  # refused, never truncated
        raise ConfigError(f"{flag(name)} must be an integer (got {value!r})")
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if tp is list:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split()
        if tp is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if tp is float and isinstance(value, str):
            return float(value)  # YAML reads 1e-3 as a string
        if tp in (int, float) and isinstance(value, bool):
            raise TypeError
        return tp(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None


def suggest(name: str) -> str:
    known = list(FIELD_SECTION) + sorted(ACCEPTED)
    close = difflib.get_close_matches(name.replace("-", "_").lstrip("_"), known, n=1, cutoff=0.6)
    return f"; did you mean {flag(close[0])}?" if close else "; see `paratron train --help` for the flags"


def flag_problem(name: str, source: str) -> Optional[str]:
    """The one-line problem of flag ``name`` given in ``source`` (None when paratron takes it): a
    refused Megatron flag with its reason, or an unknown name with a suggestion."""
    if canonical(name) in FIELD_SECTION or canonical(name) in ACCEPTED or canonical(name) in NEGATED_FLAGS:
        return None
    if name in RETIRED:
        return f"{flag(name)} ({source}) is no longer a paratron flag: {RETIRED[name]}"
    if name in megatron_flags() or name in REFUSED:
        return f"{flag(name)} ({source}) is a Megatron-LM flag that paratron refuses: {refusal(name)}"
    return f"unknown flag {flag(name)} ({source}){suggest(name)}"


def _check_known(name: str, source: str) -> None:
    problem = flag_problem(name, source)
    if problem:
        raise ConfigError(problem)


def section_problem(name: str, section: Optional[str], source: str) -> Optional[str]:
    """A key placed under the wrong YAML section (``hidden_size`` under ``train:``): the problem, naming
    the section it belongs to (None when in place, flat, or not a config field)."""
    home = FIELD_SECTION.get(NEGATED_FLAGS.get(name, name))
    if section is None or home is None or home == section:
        return None
    return f"{name} ({source}) is under {section}: but belongs under {home}:; move it there"


def apply_dict(cfg: Config, values: dict, source: str, problems: Optional[list] = None,
               section: Optional[str] = None) -> None:
    """Apply a flat or sectioned mapping of Megatron-named settings (from YAML); a key under the wrong
    section is a problem. ``problems``: a list that collects each problem (else the first raises)."""
    out = [] if problems is None else problems
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict) and section is None:
            apply_dict(cfg, value, source, out, key)
            continue
        name = canonical(str(key).replace("-", "_"))
        if section_problem(name, section, source):
            out.append(section_problem(name, section, source))
            continue
        if name in NEGATED_FLAGS:
            try:
                cfg.set(NEGATED_FLAGS[name], not _coerce(NEGATED_FLAGS[name], value))
            except ConfigError as e:
                out.append(str(e))
            continue
        problem = flag_problem(name, source)
        if problem is None and name in ACCEPTED:
            problem = value_problem(name, [str(v) for v in (value if isinstance(value, list) else [value])])
            problem = problem and f"{problem} ({source})"
        if problem is None and name in FIELD_SECTION:
            try:
                cfg.set(name, _coerce(name, value))
            except ConfigError as e:
                problem = str(e)
        if problem:
            out.append(problem)
    if problems is None and out:
        raise ConfigProblems(out)


PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"  # package data: paratron/configs/*.yaml


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file, or a preset by name (``--config tiny`` = paratron/configs/tiny.yaml)."""
    p = Path(path)
    if not p.is_file() and (PRESET_DIR / f"{path}.yaml").is_file():
        p = PRESET_DIR / f"{path}.yaml"
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass a YAML file or a preset ({', '.join(presets())})")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"config file {p} is not valid YAML{where}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must be a mapping of flag names to values")
    return data


def _bool_value(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _OnePerModel(argparse.Action):
    """Megatron's per-layer list (``--cp-comm-type p2p a2a ...``): the one value when every layer has the
    same, else the words joined by spaces (validation checks there is one per layer)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(set(values)) == 1 else " ".join(values))


PER_LAYER_LISTS = ("cp_comm_type",)  # Megatron's one value per layer (or one for all)


def add_flags(group, names, defaults: bool = False) -> None:
    """One flag per config field of ``names``. ``defaults``: argparse fills the dataclass defaults
    (else a flag not given is absent from the namespace, so YAML values stay)."""
    for name in names:
        tp = base_type(FIELD_TYPES[name])
        kw: dict = {"dest": name, "help": field_help(name) or None}
        if defaults:
            f = next(f for f in dataclasses.fields(SECTIONS[FIELD_SECTION[name]]) if f.name == name)
            kw["default"] = f.default
        if tp is bool:  # `--bf16` as Megatron's; `--bf16 false` turns off what a YAML file set
            group.add_argument(flag(name), *FLAG_ALIASES.get(name, ()), nargs="?", const=True, type=_bool_value,
                               metavar="true|false", **kw)
        elif name == "rampup_batch_size":
            group.add_argument(flag(name), nargs=3, metavar=("START", "INCREMENT", "SAMPLES"), **kw)
        elif tp is list:
            group.add_argument(flag(name), nargs="+", **kw)
        elif name in PER_LAYER_LISTS:
            group.add_argument(flag(name), nargs="+", action=_OnePerModel, **kw)
        else:
            group.add_argument(flag(name), type=tp, **kw)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags, exactly as ``paratron train`` has them (for tools that build a tokenizer)."""
    add_flags(parser.add_argument_group("tokenizer"), TOKENIZER_FIELDS, defaults=True)


def tokenizer_config(args) -> DataConfig:
    """A DataConfig holding the tokenizer flags of parsed ``args``, validated as training validates them."""
    d = DataConfig(**{name: getattr(args, name) for name in TOKENIZER_FIELDS})
    validate_tokenizer(d)
    return d


EPILOG = ("Flags are Megatron-LM's, grouped as Megatron groups them. docs/megatron_flags.md lists every Megatron "
          "flag with paratron's answer: implemented, accepted (paratron already does what it asks) or refused (why).")


def build_parser(prog: str = "paratron train") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS, epilog=EPILOG,
                       usage="%(prog)s [--config FILE] [--FLAG [VALUE ...] ...]",
                       description="Train a GPT-style model. Flags are Megatron-LM's.")
    p.add_argument("--config", help="YAML file of settings (flat Megatron names or sections); flags override it")
    groups: dict = {}

    def group(name: str):
        title = group_of(name)
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        return groups[title]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            add_flags(group(f.name), [f.name])
    for name, target in NEGATED_FLAGS.items():
        group(target).add_argument(flag(name), dest=target, action="store_const", const=False,
                                   help=f"= {flag(target)} false")
    for name in sorted(ACCEPTED, key=lambda n: (group_of(n), n)):
        if name in FIELD_SECTION:
            continue
        nargs = megatron_flags()[name].nargs if name in megatron_flags() else "0"
        kw = {"dest": f"_accepted_{name}", "help": f"accepted: {ACCEPTED[name]}"}
        if nargs == "0":
            group(name).add_argument(flag(name), action="store_true", **kw)
        else:
            group(name).add_argument(flag(name), nargs=None if nargs == "1" else int(nargs) if nargs.isdigit()
                                     else nargs, metavar="VALUE", **kw)
    return p


def _flag_name(tok: str) -> Optional[str]:
    if not tok.startswith("--") or tok == "--":
        return None
    return tok[2:].split("=", 1)[0].replace("-", "_")


def screen_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the flags paratron does not take, one problem per such flag). A refused or
    unknown flag is dropped with the values that follow it, so that the rest is still checked."""
    kept, problems, skipping = [], [], False
    for tok in argv:
        name = _flag_name(tok)
        if name is None:
            if not skipping:
                kept.append(tok)
            continue
        problem = None if name in ("config", "help") else flag_problem(name, "command line")
        skipping = problem is not None
        if problem:
            problems.append(problem)
        elif name not in ("config", "help") and canonical(name) != name:  # --disable-X spells --no-X
            kept.append("--" + canonical(name).replace("_", "-") + tok[len(name) + 2:])
        else:
            kept.append(tok)
    return kept, problems


def repeated_flags(argv: list[str]) -> list[str]:
    """One warning per flag given more than once with different values (argparse, as Megatron's, keeps
    the last one without a word: ``--lr 1e-3 ... --lr 2e-3`` is often a script edited in one place only)."""
    seen: dict = {}
    name, values = None, []
    for tok in [*argv, "--"]:
        if _flag_name(tok) is not None or tok == "--":
            if name is not None:
                seen.setdefault(canonical(name), []).append(" ".join(values) or "(no value)")
            name, values = _flag_name(tok), []
            if name is not None and "=" in tok:
                values.append(tok.split("=", 1)[1])
        elif name is not None:
            values.append(tok)
    return [f"WARNING: {flag(n)} is given {len(v)} times ({', '.join(v)}); the last one, {v[-1]}, is used"
            for n, v in seen.items() if len(set(v)) > 1 and n not in ("help",)]


def _accepted_problems(values: dict) -> list[str]:
    out = []
    for key in [k for k in values if k.startswith("_accepted_")]:
        value = values.pop(key)
        if value is not True:
            problem = value_problem(key[len("_accepted_"):], [str(v) for v in
                                                              (value if isinstance(value, list) else [value])])
            out += [problem] if problem else []
    return out


def resolve_alone(cfg: Config, world_size: Optional[int] = None) -> Config:
    """``resolve(cfg, world_size)`` with what the config holds alone: no tokenizer file, no checkpoint."""
    need = "parse with paratron.train.resolve.parse_args (as `paratron train` does)"
    if cfg.ckpt.use_checkpoint_args and (cfg.ckpt.load or cfg.ckpt.pretrained_checkpoint):
        raise ConfigError(f"--use-checkpoint-args reads the checkpoint to load, which paratron.config does not; "
                          f"{need}")
    return resolve_config(cfg, world_size)


def parse_args(argv: Optional[list[str]] = None, base: Optional[Config] = None, world_size: Optional[int] = None,
               *, resolve: Callable[[Config, Optional[int]], Config] = resolve_alone) -> Config:
    """Build a Config from YAML (``--config``) overridden by flags, then resolve it (for ``world_size``
    processes; by default torch.distributed's or torchrun's WORLD_SIZE, else 1) with ``resolve(cfg,
    world_size)``: by default :func:`resolve_alone`, which reads no file (a tokenizer with files and
    --use-checkpoint-args need paratron.train.resolve.parse_args, which passes the run's resolve).
    Every problem of the command line (flags, values, YAML, validation) is reported at once: one
    :class:`ConfigProblems` (a ConfigError) listing them all."""
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings = repeated_flags(argv)
    argv, problems = screen_argv(argv)
    try:
        values = vars(build_parser().parse_args(argv))
    except ConfigError as e:
        raise ConfigProblems(problems + [str(e)]) from None
    problems += _accepted_problems(values)
    cfg = base if base is not None else Config()
    yaml_problems = 0
    if "config" in values:
        path = values.pop("config")
        before = len(problems)
        apply_dict(cfg, load_yaml(path), f"in {path}", problems)
        yaml_problems = len(problems) - before
    if ({"data_path", "train_data_path", "data_args_path", "per_split_data_args_path"} & values.keys()) \
            and "mock_data" not in values:
        cfg.data.mock_data = False  # real data on the command line replaces a preset's mock data
    for name, value in values.items():
        if name == "rampup_batch_size":
            value = [int(v) for v in value]
        cfg.set(name, value)
    try:
        if not yaml_problems:  # a YAML value that was refused left its field unset: resolve() would only echo it
            cfg = resolve(cfg, world_size)
    except ConfigProblems as e:
        problems += e.problems
    except UserError as e:
        problems.append(str(e))
    if problems:
        raise ConfigProblems(problems)  # (the errors alone: a repeated flag is then beside the point)
    if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank; in the run's log, as its other warnings
        for warning in warnings:
            print(f" {warning}", flush=True)
    return cfg
