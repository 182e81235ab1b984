"""The body of a forked test process that runs a script as Python runs ``__main__`` (tests/parallel/cli.py's ranks,
tests/interpret.py's Triton scripts)."""
import os
import sys
import traceback


def run_as_main(out: str, body) -> None:
    """``body()`` with this process's stdout into ``out``.out and stderr into ``out``.err; exits with the status
    Python would give (``sys.exit``'s code; 1 after an uncaught exception, its traceback on stderr)."""
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    code = 0
    try:
        body()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # (a message: Python prints it and exits 1)
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (reported as Python reports an uncaught exception)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
