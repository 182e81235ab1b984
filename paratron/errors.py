"""The one error hierarchy of paratron, and how every command reports it.

A :class:`UserError` is a mistake the user can fix (a flag, a file, a checkpoint); its message is one
line naming the problem and the fix. Every command (``paratron train | demo | preprocess | tokenizer
train | convert``, ``pretrain_gpt.py``, ``tools/preprocess_data.py``) ends on one with exactly one
line on stderr, ``<command>: error: <message>``, and exit code 2 (:data:`EXIT_USER_ERROR`), never a
traceback. Anything else is a bug and keeps its traceback.

Under torchrun (``WORLD_SIZE`` > 1) every rank runs the same command and most mistakes are found by
all of them; the line is printed once, by the lowest rank that finds it: rank 0 prints at once, a
higher rank waits (:func:`rank_grace_s`) and is stopped by torchrun's agent when a lower rank has
already failed. Each failing rank also writes its line to torch elastic's error file, so that
torchrun's report (and ``paratron launch``, which ends with the line and exit code 2) shows it.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys
import time
from typing import Callable, Optional, Sequence

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Base of every error a user can fix; the message is one line."""


class ConfigError(UserError, ValueError):
    """A mistake in the configuration (flags, YAML, their combination)."""


class FrozenConfigError(ConfigError, AttributeError):
    """A write to a config after ``resolve()``: code must build a modified copy instead."""


class DataError(UserError, ValueError):
    """A data problem: a missing, truncated or foreign file, a bad flag value, an empty split."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are a :class:`ConfigError` (one line, no usage dump); a negative number
    in exponent form (``--adam-eps -1e-8``) is a value, as ``-1`` and ``-0.5`` are, not a flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")

    def error(self, message):
        raise ConfigError(message)


def os_error_reason(e: OSError) -> str:
    """An OSError as a short phrase naming the path and the errno; a full disk is named as such."""
    if e.errno == errno.ENOSPC:
        return "the disk is full (ENOSPC: no space left on device)"
    code = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or str(e) or type(e).__name__}{where}" + (f" ({code})" if code else "")


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def launched_rank() -> Optional[int]:
    """This process's global rank when torchrun (or ``paratron launch``) started several; else None."""
    try:
        return int(os.environ["RANK"]) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    except (KeyError, ValueError):
        return None


def rank_grace_s(rank: int) -> float:
    """How long rank ``rank`` waits before printing its error: long enough for torchrun's agent (which
    checks its workers every 0.1 s) to stop it when a lower rank failed first; 0.5 s a rank, at most 4 s."""
    return 0.5 * min(rank, 8)


def record_for_launcher(line: str) -> None:
    """Write ``line`` to torch elastic's error file of this worker (its report then shows the line)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass


def report_user_error(line: str) -> None:
    """Print ``line`` on stderr; under torchrun only the lowest failing rank gets to (module docstring)."""
    rank = launched_rank()
    if rank is not None:
        record_for_launcher(line)
        if rank > 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's stop ends this process quietly
            time.sleep(rank_grace_s(rank))
    print(line, file=sys.stderr, flush=True)


def run_command(prog: str, fn: Callable[[list], int], argv: Sequence[str], also: tuple = ()) -> int:
    """``fn(argv)`` with paratron's error convention: a :class:`UserError` (or one of ``also``, e.g.
    OSError for file tools) prints ``prog: error: message`` and returns 2; Ctrl-C returns 130."""
    try:
        return fn(list(argv))
    except (UserError, *also) as e:
        if isinstance(e, OSError) and not isinstance(e, UserError) and e.filename:
            message = f"{e.filename}: {e.strerror or e.__class__.__name__}"
        else:
            message = str(e) or e.__class__.__name__
        report_user_error(f"{prog}: error: {one_line(message)}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
