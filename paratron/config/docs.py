"""docs/config.md, generated from the sections (``python tools/gen_config_docs.py``)."""
from __future__ import annotations

import dataclasses
import typing

from .parse import ACCEPTED_NO_OP_FLAGS, FLAG_ALIASES, NEGATED_FLAGS, UNSUPPORTED_MEGATRON_FLAGS
from .ranges import RANGES
from .sections import SECTIONS, TOKENIZER_FIELDS, base_type, flag

DERIVED = """## How a config is resolved

`resolve()` (which `paratron train` and `pretrain_gpt.py` run once, after reading YAML and flags)
checks each section, computes every value left to a default, and freezes the config: no module
changes it afterwards. It derives `--kv-channels`, `--ffn-hidden-size`, `--num-query-groups`,
`--max-position-embeddings`, `--virtual-pipeline-model-parallel-size` (from
`--num-layers-per-virtual-pipeline-stage`), `--recompute-granularity selective` (from
`--recompute-activations`), `--fp8-format hybrid` (from `--fp8-hybrid`), `--tokenizer-type
NullTokenizer` with `--vocab-size 50257` for `--mock-data` without tokenizer flags, the data-parallel size (processes / (TP x PP x CP)), the default
`--global-batch-size` (micro-batch x data-parallel size), `--train-iters` from `--train-samples`, and
`--vocab-size` from the tokenizer. Before any of that, every number is checked against its range
(the table's last column; `paratron/config/ranges.py`), whether it came from the command line, a
YAML file or a preset: `--adam-beta1 2` is `error: --adam-beta1 must be in [0, 1) (got 2.0)`, exit
code 2, and an integer flag refuses a fraction (`train_iters: 2.5` in YAML) instead of truncating it. Python code that needs another config copies it:
`cfg.unfrozen()` (the values as given; resolve it again) or `dataclasses.replace(...)`.

The tokenizer flags ({tokenizer}) are the same set, with the same defaults and meaning, in
`paratron preprocess`, so one set of flags gives one vocabulary in both.

## Flags that are errors until their feature exists

`--cp-comm-type allgather` or `a2a+p2p` and `--hierarchical-context-parallel-sizes` (context
parallelism has `p2p` and `a2a`; see docs/parallelism.md), `--num-experts` with `--context-parallel-size`
above 1 and `--attention-dropout` under context parallelism: each is a one-line error, exit code 2. So
are flags that would do nothing: `--moe-*` flags, or `--expert-model-parallel-size` /
`--expert-tensor-parallel-size` above 1, without `--num-experts` (see docs/moe.md). `--sample-prompt
TEXT` prints the trained model's greedy continuation of TEXT (up to 64 tokens) at the end of training;
it needs `--pipeline-model-parallel-size 1`, `--context-parallel-size 1` and no `--sequence-parallel`
(docs/inference.md).
"""


def reference_markdown() -> str:
    """The config reference for docs/, generated from the dataclasses (see tools/gen_config_docs.py)."""
    lines = ["# Configuration reference", "",
             "Generated from `paratron/config/sections.py` by `python tools/gen_config_docs.py`. Every field is a",
             "command-line flag (`--hidden-size`) and a YAML key (`hidden_size`), with Megatron-LM's name.",
             "A boolean flag alone sets it (`--bf16`); `--bf16 false` turns off what a YAML file or preset set.",
             ""]
    for sec, cls in SECTIONS.items():
        lines += [f"## {sec}", "", "| flag | type | default | range |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = getattr(base_type(hints[f.name]), "__name__", str(hints[f.name]))
            spellings = [flag(f.name), *FLAG_ALIASES.get(f.name, ()),
                         *(flag(neg) for neg, target in NEGATED_FLAGS.items() if target == f.name)]
            lines.append(f"| {' / '.join(f'`{s}`' for s in spellings)} | {tname} | `{default}` | "
                         f"{RANGES[f.name].text if f.name in RANGES else ''} |")
        lines.append("")
    lines += DERIVED.format(tokenizer=", ".join(f"`{flag(n)}`" for n in TOKENIZER_FIELDS)).splitlines()
    lines += ["", "## Megatron flags accepted with no effect", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(ACCEPTED_NO_OP_FLAGS)), "",
              "## Megatron flags not supported yet (a clear error)", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(UNSUPPORTED_MEGATRON_FLAGS)), ""]
    return "\n".join(lines)
