"""Write Megatron-LM's flag list (tests/data/megatron_flags.tsv and the package's copy,
paratron/config/megatron_args.tsv) from a Megatron-LM checkout, by building its own parser.

    python tools/dump_megatron_flags.py /path/to/Megatron-LM

The checkout's ``megatron/training/arguments.py`` is imported (with the venv's torch) and its
``add_megatron_arguments`` parser is walked, with the extra argument group ``pretrain_gpt.py`` adds
(``megatron/post_training/arguments.py``'s ``add_modelopt_args``, group "modelopt-generic", where
``--enable-gpt-oss`` and ``--export-force-local-attention`` live): every ``--flag`` with its argument
group and arity.
``uses`` counts the GPT/Llama/MoE example scripts and functional-test configs of the checkout that
name the flag (examples/{gpt3,llama,mixtral,megatron_fsdp,gptoss}, post-training model
definitions, tests/functional_tests/test_cases/{gpt,moe,mixtral} training configs).
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT_GLOBS = ("examples/gpt3/*.sh", "examples/llama/*.sh", "examples/mixtral/*.sh", "examples/megatron_fsdp/*.sh",
                "examples/gptoss/*.sh", "examples/post_training/modelopt/conf/*/*.sh")
CONFIG_GLOBS = tuple(f"tests/functional_tests/test_cases/{d}/*/model_config.yaml" for d in ("gpt", "moe", "mixtral"))


def megatron_actions(repo: Path) -> list[tuple[str, str, str]]:
    """(flag, group title, nargs) of every long option of Megatron's training parser."""
    if not hasattr(typing, "override"):  # Megatron's newest code imports typing.override (Python 3.12)
        typing.override = lambda f: f
    sys.path.insert(0, str(repo))
    from megatron.training import arguments
    from megatron.post_training.arguments import add_modelopt_args  # pretrain_gpt.py's extra_args_provider
    parser = add_modelopt_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            nargs = "0" if action.nargs == 0 else "1" if action.nargs is None else str(action.nargs)
            rows += [(o, group.title, nargs) for o in action.option_strings if o.startswith("--") and o != "--help"]
    return rows


def script_uses(repo: Path) -> collections.Counter:
    import yaml
    uses: collections.Counter = collections.Counter()
    for pattern in SCRIPT_GLOBS:
        for f in repo.glob(pattern):
            uses.update(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]+)", f.read_text())))
    for pattern in CONFIG_GLOBS:
        for f in repo.glob(pattern):
            try:
                d = yaml.safe_load(f.read_text()) or {}
            except yaml.YAMLError:
                continue
            if d.get("MODE") != "inference":
                uses.update(set(d.get("MODEL_ARGS") or {}))
    return uses


def main() -> None:
    repo = Path(sys.argv[1]).resolve()
    version = {}
    exec((repo / "megatron/core/package_info.py").read_text().split("import os")[0], version)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows, uses = megatron_actions(repo), script_uses(repo)
    head = (f"# Megatron-LM {version['__version__']} commit {commit or 'unknown'}: megatron/training/arguments.py"
            " + megatron/post_training/arguments.py\n")
    (ROOT / "tests/data/megatron_flags.tsv").write_text(
        head + "# flag\tgroup\tnargs\tuses\n" + "".join(f"{f}\t{g}\t{n}\t{uses[f]}\n" for f, g, n in rows))
    (ROOT / "paratron/config/megatron_args.tsv").write_text(
        head + "".join(f"{f}\t{g}\t{n}\n" for f, g, n in rows))


if __name__ == "__main__":
    main()
