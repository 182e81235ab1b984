"""What every benchmark record states about the code it measured, and the one way records are written."""
import os
import subprocess
import sys
from datetime import datetime, timezone
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


def write_record(record_dir, name: str, title: str, hardware: str, facts: dict, body: str) -> Path:
    """Write ``{record_dir}/{name}_{UTC stamp}.md``: the title, date, hardware, torch version, commit and
    command, then ``facts`` (label: text) as more list items, then ``body``. Returns the path."""
    import torch
    stamp = datetime.now(timezone.utc)
    path = Path(record_dir) / f"{name}_{stamp:%Y%m%d_%H%M%S}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"# {title}", "", f"- date: {stamp:%Y-%m-%d %H:%M} UTC", f"- hardware: {hardware}",
            f"- torch: {torch.__version__}", f"- commit: {commit()}", f"- command: `{' '.join(sys.argv)}`"]
    head += [f"- {label}: {text}" for label, text in facts.items()]
    path.write_text("\n".join(head) + "\n\n" + body.rstrip() + "\n")
    print(f"record: {path}", flush=True)
    return path


def at_power_limit(fn, seconds: float = 1.5) -> None:
    """Call ``fn()`` for ``seconds`` (synchronising every 20 calls), so that the GPU sits at its power limit, where
    the training step runs, when a kernel is timed next."""
    import time
    import torch
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()


def cuda_median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of a call of ``fn()`` (each call between two CUDA events, after ``warmup`` calls)."""
    import torch
    for _ in range(warmup):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for e in events[1:]:
        fn()
        e.record()
    events[-1].synchronize()
    return sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))[iters // 2]


def cuda_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn()`` on the current CUDA stream (CUDA events, after ``warmup`` calls)."""
    import torch
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
