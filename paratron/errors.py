"""The one error hierarchy of paratron, and how every command reports it.

A :class:`UserError` is a mistake the user can fix (a flag, a file, a checkpoint); its message is one
line naming the problem and the fix. Every command (``paratron train | demo | preprocess | tokenizer
train | convert``, ``pretrain_gpt.py``, ``tools/preprocess_data.py``) ends on one with exactly one
line on stderr, ``<command>: error: <message>``, and exit code 2 (:data:`EXIT_USER_ERROR`), never a
traceback. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import re
import sys
from typing import Callable, Sequence

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
        print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
