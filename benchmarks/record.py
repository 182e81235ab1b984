"""What every benchmark record states about the code it measured."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """Short hash of HEAD; on a copy without git history (the device machine's) the hash passed in
    $PARATRON_COMMIT by the command that started the run, else "unknown"."""
    if os.environ.get("PARATRON_COMMIT"):
        return os.environ["PARATRON_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
