"""`paratron launch`: torchrun with paratron's error convention.

    paratron launch [torchrun flags] COMMAND [flags]      e.g. paratron launch --nproc-per-node 2 train ...
    paratron launch [torchrun flags] SCRIPT.py [flags]    e.g. paratron launch --nproc-per-node 2 pretrain_gpt.py ...

The flags before COMMAND are torchrun's own (``--nproc-per-node``, ``--nnodes``, ``--rdzv-*``, ...) and
torch's elastic agent starts and watches the workers exactly as ``torchrun`` does; COMMAND is a
paratron command (``train``, ``generate``, ...), run as ``python -m paratron COMMAND``. What differs is
the end of a failed run: when a worker stops on a user error (exit code 2; the lowest rank that found
it has printed its one line, paratron/errors.py), the launcher adds nothing (not the agent's report)
and exits 2. Any other failure (a crash, a signal) ends with torchrun's report, as under torchrun.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

from .errors import EXIT_USER_ERROR

COMMANDS = ("train", "demo", "generate", "serve", "preprocess", "convert")
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run")


def _quiet_agent() -> None:
    """The agent's own lines (OMP_NUM_THREADS notice, 'Sending process ... SIGTERM', 'failed (exitcode: 2)')
    repeat what the worker said; a crash still ends with the agent's report (raised, not logged)."""
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_args(argv: list[str]):
    """torchrun's parsed arguments, with a paratron COMMAND turned into ``-m paratron COMMAND``."""
    from torch.distributed import run as torchrun
    args = torchrun.parse_args(argv)
    if args.training_script in COMMANDS and not args.module and not args.no_python:
        args.training_script_args = [args.training_script, *args.training_script_args]
        args.training_script, args.module = "paratron", True
    return args


def launch_main(argv: Optional[list[str]] = None) -> int:
    """Run the workers under torch's elastic agent; exit 2, silently, when one stopped on a user error."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n", 1)[1])
        return 0
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = launch_args(argv)
    _quiet_agent()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        if any(f.exitcode == EXIT_USER_ERROR for f in e.failures.values()):
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    sys.exit(launch_main())
