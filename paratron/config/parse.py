"""Building a Config: YAML files and presets, then command-line flags (Megatron's names), then
``resolve()``. The tokenizer flags are defined here once, for ``paratron train`` and ``paratron
preprocess`` alike."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import ArgumentParser, ConfigError
from .sections import FIELD_SECTION, FIELD_TYPES, SECTIONS, TOKENIZER_FIELDS, Config, DataConfig, base_type, flag

# Megatron flags that exist upstream but that paratron does not implement yet: naming them is a
# clear "not supported" error rather than "unknown flag".
UNSUPPORTED_MEGATRON_FLAGS = {
    "tp_comm_overlap", "use_torch_fsdp2", "split_sentences",
    "transformer_impl", "use_flash_attn",
}

# Megatron flags that are accepted for compatibility and have no effect in paratron (the behaviour
# they select is the only one paratron has).
ACCEPTED_NO_OP_FLAGS = {"use_mcore_models", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
                        "no_gradient_accumulation_fusion", "use_dist_ckpt",
                        "ckpt_fully_parallel_save", "ckpt_fully_parallel_load", "ckpt_assume_constant_structure"}

# Megatron's spellings that flag() does not produce, as extra option strings of the field's flag.
FLAG_ALIASES = {"override_opt_param_scheduler": ["--override-opt_param-scheduler"],
                "use_checkpoint_opt_param_scheduler": ["--use-checkpoint-opt_param-scheduler"]}

# Megatron's negative switches: --no-X sets the (default-on) field X to false.
NEGATED_FLAGS = {"no_check_for_nan_in_loss_and_grad": "check_for_nan_in_loss_and_grad"}

HELP = {  # shown by --help of train and preprocess
    "tokenizer_type": "GPT2BPETokenizer | HuggingFaceTokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer "
                      "| Llama2Tokenizer | TikTokenizer | NullTokenizer | ByteLevelTokenizer",
    "vocab_file": "GPT2BPETokenizer: vocab.json",
    "merge_file": "GPT2BPETokenizer: merges.txt",
    "tokenizer_model": "tokenizer.json / directory / .model / .tiktoken file",
    "vocab_size": "NullTokenizer vocabulary; TikTokenizer vocabulary cut",
    "vocab_extra_ids": "SentencePieceTokenizer: number of <extra_id_i> tokens to add",
    "tiktoken_pattern": "TikTokenizer split pattern: v1 | v2",
}


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
    known = list(FIELD_SECTION) + sorted(ACCEPTED_NO_OP_FLAGS)
    close = difflib.get_close_matches(name.replace("-", "_").lstrip("_"), known, n=1, cutoff=0.6)
    return f"; did you mean {flag(close[0])}?" if close else "; see `paratron train --help` for the flags"


def _check_known(name: str, source: str) -> None:
    if name in FIELD_SECTION or name in ACCEPTED_NO_OP_FLAGS or name in NEGATED_FLAGS:
        return
    if name in UNSUPPORTED_MEGATRON_FLAGS:
        raise ConfigError(f"{flag(name)} ({source}) is a Megatron-LM flag that paratron does not support yet")
    raise ConfigError(f"unknown flag {flag(name)} ({source}){suggest(name)}")


def apply_dict(cfg: Config, values: dict, source: str) -> None:
    """Apply a flat or sectioned mapping of Megatron-named settings (from YAML)."""
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            apply_dict(cfg, value, source)
            continue
        name = str(key).replace("-", "_")
        _check_known(name, source)
        if name in ACCEPTED_NO_OP_FLAGS and name not in FIELD_SECTION:
            continue
        if name in NEGATED_FLAGS:
            cfg.set(NEGATED_FLAGS[name], not _coerce(NEGATED_FLAGS[name], value))
            continue
        cfg.set(name, _coerce(name, value))


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


def add_flags(group, names, defaults: bool = False) -> None:
    """One flag per config field of ``names``. ``defaults``: argparse fills the dataclass defaults
    (else a flag not given is absent from the namespace, so YAML values stay)."""
    for name in names:
        tp = base_type(FIELD_TYPES[name])
        kw: dict = {"dest": name, "help": HELP.get(name)}
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
        else:
            group.add_argument(flag(name), type=tp, **kw)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags, exactly as ``paratron train`` has them (for tools that build a tokenizer)."""
    add_flags(parser.add_argument_group("tokenizer"), TOKENIZER_FIELDS, defaults=True)


def tokenizer_config(args) -> DataConfig:
    """A DataConfig holding the tokenizer flags of parsed ``args``, validated as training validates them."""
    from .validate import validate_tokenizer
    d = DataConfig(**{name: getattr(args, name) for name in TOKENIZER_FIELDS})
    validate_tokenizer(d)
    return d


def build_parser(prog: str = "paratron train") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                       description="Train a GPT-style model. Flags are Megatron-LM's.")
    p.add_argument("--config", help="YAML file of settings (flat Megatron names or sections); flags override it")
    for sec, cls in SECTIONS.items():
        add_flags(p.add_argument_group(sec), [f.name for f in dataclasses.fields(cls)])
    for name, target in NEGATED_FLAGS.items():
        p.add_argument(flag(name), dest=target, action="store_const", const=False, help=f"= {flag(target)} false")
    for name in sorted(ACCEPTED_NO_OP_FLAGS - set(FIELD_SECTION)):
        p.add_argument(flag(name), dest=f"_noop_{name}", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[list[str]] = None, base: Optional[Config] = None,
               world_size: Optional[int] = None) -> Config:
    """Build a Config from YAML (``--config``) overridden by flags, then ``resolve()`` it (for
    ``world_size`` processes; by default torch.distributed's or torchrun's WORLD_SIZE, else 1)."""
    from .validate import resolve
    argv = list(sys.argv[1:] if argv is None else argv)
    for tok in argv:  # catch unknown flags first, with a suggestion
        if tok.startswith("--") and tok != "--":
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            if name != "config" and not name.startswith("noop_"):
                _check_known(name, "command line")
    values = vars(build_parser().parse_args(argv))
    cfg = base if base is not None else Config()
    if "config" in values:
        path = values.pop("config")
        apply_dict(cfg, load_yaml(path), f"in {path}")
    if ({"data_path", "train_data_path"} & values.keys()) and "mock_data" not in values:
        cfg.data.mock_data = False  # real data on the command line replaces a preset's mock data
    for name, value in values.items():
        if name.startswith("_noop_"):
            continue
        if name == "rampup_batch_size":
            value = [int(v) for v in value]
        cfg.set(name, value)
    return resolve(cfg, world_size)
