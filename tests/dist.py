"""Run a function on N gloo ranks on the CPU (tests/parallel use it) and collect what each returns.

The ranks are forked from a fork server (multiprocessing's "forkserver") that has imported torch and
paratron once for the whole test session: spawned afresh, every rank of every launch paid ~2.5 s of CPU
for those imports (several seconds a launch on 2 cores). As with spawn, a rank shares nothing with the
pytest process: the server is a fresh interpreter, started at the first launch, that only imports; each
rank gets the environment of its own launch (what the server read at import time aside)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paratron.parallel.dims import shutdown_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["pytest", "torch._dynamo", "paratron.train.loop", "tests.parallel.common"]  # what the ranks import


def _worker(rank: int, world: int, port: int, out_dir: str, env: dict, fn, args):
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ok = False
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
        ok = True
    except Exception:
        (Path(out_dir) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        shutdown_distributed(synchronize=ok)


def run_ranks(world: int, fn, *args, tmp_dir: str | Path) -> list:
    """fn(rank, world, *args) on each rank; returns the list of results (torch-saveable). A launch whose
    rendezvous port another process took between its choice and the rendezvous (EADDRINUSE, before any rank
    ran ``fn``) is launched again on another port, at most twice."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first launch)
    for attempt in range(3):
        out = Path(tmp_dir) / f"ranks{world}_{free_port()}"
        out.mkdir(parents=True)
        try:
            mp.start_processes(_worker, args=(world, free_port(), str(out), dict(os.environ), fn, args),
                               nprocs=world, join=True, start_method="forkserver")
            break
        except Exception as e:
            errs = [p.read_text() for p in sorted(out.glob("*.err"))]
            if "EADDRINUSE" in str(e) and not errs and attempt < 2:
                continue
            raise AssertionError("a rank failed:\n" + ("\n".join(errs) or str(e))) from None
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(world)]
