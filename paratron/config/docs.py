"""docs/config.md and docs/megatron_flags.md, generated from the sections and the Megatron flag table
(``python tools/gen_config_docs.py``)."""
from __future__ import annotations

import dataclasses
import typing

from .help import field_help
from .megatron_flags import (ACCEPTED_STATUS, IMPLEMENTED, PARATRON_GROUP, REFUSED_STATUS, group_of, megatron_flags,
                             megatron_version, status)
from .megatron_reasons import ACCEPTED
from .parse import FLAG_ALIASES, NEGATED_FLAGS
from .ranges import RANGES
from .sections import SECTIONS, TOKENIZER_FIELDS, base_type, flag

DERIVED = """## How a config is resolved

`resolve()` (which `paratron train` and `pretrain_gpt.py` run once, after reading YAML and flags)
checks each section, computes every value left to a default, and freezes the config: no module
changes it afterwards. It derives `--kv-channels`, `--ffn-hidden-size`, `--num-query-groups`,
`--max-position-embeddings`, `--virtual-pipeline-model-parallel-size` (from
`--num-layers-per-virtual-pipeline-stage`), `--recompute-granularity selective` (from
`--recompute-activations`), `--fp8-format hybrid` (from `--fp8-hybrid`), `--position-embedding-type rope`
(from `--use-rotary-position-embeddings`), `--tokenizer-type GPT2BPETokenizer` when `--vocab-file` /
`--merge-file` are given without a type (Megatron's default, with `--mock-data` too), `--tokenizer-type
NullTokenizer` with `--vocab-size 50257` for `--mock-data` without tokenizer flags, the data-parallel size (processes / (TP x PP x CP)), the default
`--global-batch-size` (micro-batch x data-parallel size), `--train-iters` from `--train-samples`, and
`--vocab-size` from the tokenizer. Before any of that, every number is checked against its range
(the table's last column; `paratron/config/ranges.py`), whether it came from the command line, a
YAML file or a preset: `--adam-beta1 2` is `error: --adam-beta1 must be in [0, 1) (got 2.0)`, exit
code 2, and an integer flag refuses a fraction (`train_iters: 2.5` in YAML) instead of truncating it. Python code that needs another config copies it:
`cfg.unfrozen()` (the values as given; resolve it again) or `dataclasses.replace(...)`.
With `--use-checkpoint-args`, the model fields and tokenizer flags are first taken from the config stored
in the `--load` checkpoint. Every problem of a command line (refused or unknown flags, bad values,
failed checks of each section) is reported together in one error before any work, exit code 2.

The tokenizer flags ({tokenizer}) are the same set, with the same defaults and meaning, in
`paratron preprocess`, so one set of flags gives one vocabulary in both.

## Flags that are errors until their feature exists

`--attention-dropout` under context parallelism is a one-line error, exit code 2. So
are flags that would do nothing: `--moe-*` flags, or `--expert-model-parallel-size` /
`--expert-tensor-parallel-size` above 1, without `--num-experts` (see docs/moe.md). `--sample-prompt
TEXT` prints the trained model's greedy continuation of TEXT (up to 64 tokens) at the end of training;
it needs `--pipeline-model-parallel-size 1`, `--context-parallel-size 1` and no `--sequence-parallel`
(docs/inference.md).
"""


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _field_rows() -> dict[str, list[str]]:
    """Table rows of every config field and accepted flag, by Megatron argument group."""
    rows: dict[str, list[str]] = {}
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = getattr(base_type(hints[f.name]), "__name__", str(hints[f.name]))
            spellings = [flag(f.name), *FLAG_ALIASES.get(f.name, ()),
                         *(flag(neg) for neg, target in NEGATED_FLAGS.items() if target == f.name)]
            rows.setdefault(group_of(f.name), []).append(
                f"| {' / '.join(f'`{s}`' for s in spellings)} | {tname} | `{default}` | "
                f"{RANGES[f.name].text if f.name in RANGES else ''} | {_cell(field_help(f.name))} |")
    for name in sorted(ACCEPTED):
        if name not in SECTIONS:
            rows.setdefault(group_of(name), []).append(f"| `{flag(name)}` | accepted | | | {_cell(ACCEPTED[name])} |")
    return rows


def reference_markdown() -> str:
    """The config reference for docs/, generated from the dataclasses and the Megatron flag table
    (see tools/gen_config_docs.py)."""
    lines = ["# Configuration reference", "",
             "Generated from `paratron/config/` (sections.py, help.py, megatron_reasons.py, ranges.py) by "
             "`python tools/gen_config_docs.py`.",
             "Every field is a command-line flag (`--hidden-size`) and a YAML key (`hidden_size`), with Megatron-LM's",
             "name, grouped as Megatron's parser groups it (`paratron`: paratron's own flags). A boolean flag alone",
             "sets it (`--bf16`); `--bf16 false` turns off what a YAML file or preset set. *accepted* flags are",
             "parsed and paratron already behaves as they ask (the reason is given). docs/megatron_flags.md lists",
             "every Megatron flag, including the refused ones, with the reason. The range column is checked",
             "before anything is built (`paratron/config/ranges.py`).", ""]
    for group, rows in sorted(_field_rows().items(), key=lambda kv: (kv[0] == PARATRON_GROUP, kv[0].lower())):
        lines += [f"## {group}", "", "| flag | type | default | range | description |", "|---|---|---|---|---|",
                  *rows, ""]
    lines += DERIVED.format(tokenizer=", ".join(f"`{flag(n)}`" for n in TOKENIZER_FIELDS)).splitlines()
    return "\n".join(lines) + "\n"


def megatron_flags_markdown() -> str:
    """docs/megatron_flags.md: every flag of Megatron-LM's training parser with paratron's status."""
    flags = megatron_flags()
    counts: dict[str, int] = {}
    by_group: dict[str, list[str]] = {}
    for name, mf in flags.items():
        st, reason = status(name)
        counts[st] = counts.get(st, 0) + 1
        by_group.setdefault(mf.group, []).append(f"| `{mf.flag}` | {st} | {_cell(reason)} |")
    lines = ["# Megatron-LM flags in paratron", "",
             f"Generated by `python tools/gen_config_docs.py` from the flag list of {megatron_version()}",
             "(`paratron/config/megatron_args.tsv`, written by tools/dump_megatron_flags.py) and paratron's table",
             "(`paratron/config/megatron_flags.py`). *implemented*: a config field the code reads; *accepted*:",
             "paratron already does what the flag asks; *refused*: the run stops before any work with this one-line reason",
             "(all problems of a command line are reported together, exit code 2).", "",
             ", ".join(f"{counts.get(s, 0)} {s}" for s in (IMPLEMENTED, ACCEPTED_STATUS, REFUSED_STATUS))
             + f" of {len(flags)} flags.", ""]
    for group in sorted(by_group, key=str.lower):
        lines += [f"## {group}", "", "| flag | status | what paratron does |", "|---|---|---|", *by_group[group], ""]
    return "\n".join(lines)
