"""`paratron` command line: train | demo | preprocess | tokenizer train | convert | generate | serve | plan |
fill-mask | config-docs.

User mistakes (bad flags, bad data, unreadable checkpoints: paratron.errors.UserError) end with one
line on stderr, ``<command>: error: <message>``, and exit code 2, never a traceback.
"""
from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: paratron <command> [flags]

commands:
  train [--config FILE|PRESET] [Megatron flags]   train a model (no flags: the embedded demo; --model bert: BERT)
  demo                                            the embedded demo: Python stdlib corpus -> BPE -> train
  preprocess [Megatron preprocess_data.py flags]  JSONL -> .bin/.idx
  tokenizer train --input ... --vocab-size N --output DIR   train a byte-level BPE tokenizer
  convert --to hf|--from hf ...                   convert checkpoints to and from Hugging Face
  generate --load CKPT --prompt TEXT [...]        continue prompts with a checkpoint or HF model
  serve --load CKPT [--port 5000]                 HTTP server: Megatron's PUT /api and OpenAI's /v1 API
  plan --gpus N [--gpu h100] [model flags]          the layouts that fit, ranked by predicted tokens/s
  fill-mask --load CKPT --text "a [MASK] b"       a BERT's top tokens for each [MASK]
  launch [torchrun flags] COMMAND [flags]         torchrun for a paratron command; a user error ends
                                                  with its one line and exit code 2
  config-docs                                     print the configuration reference (Markdown)

`paratron train --help` lists every training flag."""


def user_errors() -> tuple:
    """The exceptions every command reports as one line and exit code 2 (all of paratron.errors.UserError)."""
    from .errors import UserError
    return (UserError,)


def run_train(argv: list[str]) -> int:
    from .train.resolve import parse_args
    cfg = parse_args(argv)  # a flag mistake is reported before the trainer's imports (~2 s) are paid
    if cfg.train.dry_run:  # the memory plan alone: no trainer, no process group
        from .plan.memory import dry_run
        dry_run(cfg)
        return 0
    from .train.loop import pretrain
    ok = False
    try:
        pretrain(cfg)
        ok = True
    except RuntimeError as e:  # a peer that did not answer in time: one line naming it, not a traceback
        from .train.distributed import DistributedTimeoutError, timeout_report
        report = timeout_report(e, cfg.parallel.distributed_timeout_minutes)
        if report is None:
            raise
        raise DistributedTimeoutError(report) from None
    finally:
        from .parallel.dims import shutdown_distributed
        shutdown_distributed(ok)
    return 0


def count_host_ops(cfg, kind):
    """paratron plan's count of the host's operations (train/host_ops.py: it builds a model, so torch is imported
    only when a plan runs, not for its --help)."""
    from .train.host_ops import host_ops_for
    return host_ops_for(cfg, kind)


def count_traffic(cfg, kind):
    """paratron plan's count of the memory-bound kernels' bytes (train/traffic.py; imported as count_host_ops)."""
    from .train.traffic import traffic_for
    return traffic_for(cfg, kind)


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        if not rest:
            from .demo import run_demo
            return run_demo([])
        if rest in (["-h"], ["--help"]):
            from .config import build_parser
            build_parser().print_help()
            return 0
        return run_train(rest)
    if cmd == "demo":
        from .demo import run_demo
        return run_demo(rest)
    if cmd == "preprocess":
        from .data.preprocess import main as preprocess_main
        return preprocess_main(rest)
    if cmd == "tokenizer":
        if rest[:1] in (["-h"], ["--help"]):  # the one subcommand's help
            rest = ["train", "--help"]
        if not rest or rest[0] != "train":
            from .errors import ConfigError
            raise ConfigError("usage: paratron tokenizer train --input FILES --vocab-size N --output DIR")
        from .data.bpe_train import tokenizer_train_main
        return tokenizer_train_main(rest[1:])
    if cmd == "convert":
        if rest in (["-h"], ["--help"]):  # (from its flags alone: the conversions import torch)
            from .checkpoint.convert_flags import build_parser
            build_parser().print_help()
            return 0
        from .checkpoint.convert import main as convert_main
        return convert_main(rest)
    if cmd == "fill-mask":
        from .inference.fill_mask import fill_mask_main
        return fill_mask_main(rest)
    if cmd in ("generate", "serve"):
        from .inference import cli as inference_cli
        return (inference_cli.generate_main if cmd == "generate" else inference_cli.serve_main)(rest)
    if cmd == "plan":
        from .plan.cli import plan_main
        return plan_main(rest, count_host_ops, count_traffic)
    if cmd == "launch":
        from .launch import launch_main
        return launch_main(rest)
    if cmd == "config-docs":
        from .config import reference_markdown
        print(reference_markdown())
        return 0
    from .config import ConfigError
    import difflib
    close = difflib.get_close_matches(cmd, ["train", "demo", "preprocess", "tokenizer", "convert", "generate", "serve",
                                         "fill-mask",
                                         "launch", "config-docs"], n=1)
    hint = f"; did you mean `paratron {close[0]}`?" if close else "; run `paratron --help`"
    raise ConfigError(f"unknown command {cmd!r}{hint}")


def main(argv: Optional[list[str]] = None) -> int:
    """`paratron ...`: a user error of any command is one line on stderr and exit code 2."""
    from .errors import run_command
    return run_command("paratron", dispatch, sys.argv[1:] if argv is None else argv)


def pretrain_main(argv: Optional[list[str]] = None, model: str = "gpt", prog: Optional[str] = None,
                  hybrid: bool = False) -> int:
    """`pretrain_gpt.py` / `pretrain_bert.py` / `pretrain_t5.py` (``model`` "bert", "t5": `--model` first):
    Megatron's entry points, same flags; errors as `paratron train`'s. ``hybrid`` (`pretrain_hybrid.py`,
    `pretrain_mamba.py`): a hybrid stack, all Mamba-2 layers unless --hybrid-layer-pattern (or the ratio flags)
    say otherwise, as Megatron's."""
    from .errors import run_command
    prog = prog or f"pretrain_{model}.py"

    def run(args: list[str]) -> int:
        if args in (["-h"], ["--help"]):
            from .config import build_parser
            build_parser(prog).print_help()
            return 0
        if hybrid and "--is-hybrid-model" not in args:
            args = [*args, "--is-hybrid-model"]
        return run_train(args if model == "gpt" else ["--model", model, *args])
    return run_command(prog, run, sys.argv[1:] if argv is None else argv)
