"""docs/config.md, generated from the sections (``python tools/gen_config_docs.py``)."""
from __future__ import annotations

import dataclasses
import typing

from .parse import ACCEPTED_NO_OP_FLAGS, FLAG_ALIASES, NEGATED_FLAGS, UNSUPPORTED_MEGATRON_FLAGS
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
`--vocab-size` from the tokenizer. Python code that needs another config copies it:
`cfg.unfrozen()` (the values as given; resolve it again) or `dataclasses.replace(...)`.

The tokenizer flags ({tokenizer}) are the same set, with the same defaults and meaning, in
`paratron preprocess`, so one set of flags gives one vocabulary in both.

## Flags that are errors until their feature exists

A value above 1 of `--expert-model-parallel-size` or `--expert-tensor-parallel-size`
(mixture-of-experts layers run at expert-parallel size 1 for now; see docs/moe.md), `--num-experts`
with `--tensor-model-parallel-size` or `--context-parallel-size` above 1, `--cp-comm-type allgather`
or `a2a+p2p` and `--hierarchical-context-parallel-sizes` (context parallelism has `p2p` and `a2a`;
see docs/parallelism.md), `--attention-dropout` under context parallelism, and `--sample-prompt` (no
generation in training runs yet): each is a one-line error, exit code 2.
"""


def reference_markdown() -> str:
    """The config reference for docs/, generated from the dataclasses (see tools/gen_config_docs.py)."""
    lines = ["# Configuration reference", "",
             "Generated from `paratron/config/sections.py` by `python tools/gen_config_docs.py`. Every field is a",
             "command-line flag (`--hidden-size`) and a YAML key (`hidden_size`), with Megatron-LM's name.",
             "A boolean flag alone sets it (`--bf16`); `--bf16 false` turns off what a YAML file or preset set.",
             ""]
    for sec, cls in SECTIONS.items():
        lines += [f"## {sec}", "", "| flag | type | default |", "|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = getattr(base_type(hints[f.name]), "__name__", str(hints[f.name]))
            spellings = [flag(f.name), *FLAG_ALIASES.get(f.name, ()),
                         *(flag(neg) for neg, target in NEGATED_FLAGS.items() if target == f.name)]
            lines.append(f"| {' / '.join(f'`{s}`' for s in spellings)} | {tname} | `{default}` |")
        lines.append("")
    lines += DERIVED.format(tokenizer=", ".join(f"`{flag(n)}`" for n in TOKENIZER_FIELDS)).splitlines()
    lines += ["", "## Megatron flags accepted with no effect", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(ACCEPTED_NO_OP_FLAGS)), "",
              "## Megatron flags not supported yet (a clear error)", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(UNSUPPORTED_MEGATRON_FLAGS)), ""]
    return "\n".join(lines)
