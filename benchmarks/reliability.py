"""Reliability suite (docs/reliability.md): kill -9 and SIGTERM trials against uninterrupted runs, on CPU/gloo.

    PYTHONPATH=$PWD python benchmarks/reliability.py --kill-trials 20 --sigterm-trials 5 \\
        --record-dir benchmarks/results

Layouts: one process with dropout, two processes DP2, two processes TP2 with dropout; a tiny GPT on
mock data, --save-interval 2, 12 iterations. Each layout first runs uninterrupted (the reference).

kill -9 trial: the job is the automatic-restart recipe, `torchrun --max-restarts 1 ... --save CK
--load CK`. One worker is killed (the ranks of each layout in turn, so that every rank is) with SIGKILL
after a random iteration, either mid-step (after a random delay) or mid-save (as soon as the save's
`.iter_*.partial` directory appears). torchrun restarts the workers, they resume from the latest complete checkpoint and finish.
Counted: resumed (exit 0, the last iteration reached) and identical (every logged loss, before and
after the restart, equal to the reference's).

SIGTERM trial: the ranks are started one process each (as `srun` starts them), in one process group,
with --exit-signal-handler and two DataLoader workers each; after a random iteration SIGTERM goes to
every process of the group (ranks and DataLoader workers), as SLURM and Kubernetes send it. Counted:
a checkpoint at the iteration the ranks stopped at, exit 0 on every rank, and an identical resume
(the same command again).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")
ITERS = 12
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--eval-iters", "0", "--log-interval", "1",
        "--save-interval", "2", "--device", "cpu", "--seed", "7", "--exit-signal-handler"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
LAYOUTS = {"1proc_dropout": (1, DROPOUT), "dp2": (2, NO_DROPOUT),
           "tp2_dropout": (2, DROPOUT + ["--tensor-model-parallel-size", "2"])}


def env() -> dict:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: part of the restart recipe (docs/reliability.md); without
    it restarted workers can read a dead worker's address from the shared store (pytorch#135712)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(text: str) -> dict:
    """{iteration: printed loss}; an iteration logged twice (re-run after a restart) must print the same."""
    out: dict = {}
    for it, value in LOSS.findall(text):
        out.setdefault(int(it), set()).add(value)
    return out


def identical(got: dict, ref: dict) -> bool:
    return bool(got) and all(values == {ref[it]} for it, values in got.items())


class Job:
    """A process (or several, one process group) whose merged output is read in a thread."""

    def __init__(self, cmds: list[list[str]], envs: list[dict]):
        self.procs, self.text, self.lock = [], [], threading.Lock()
        for cmd, e in zip(cmds, envs):
            group = {"process_group": self.procs[0].pid if self.procs else 0}  # one new process group
            p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 **group)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p) -> None:
        for line in p.stdout:
            with self.lock:
                self.text.append(line)

    def output(self) -> str:
        with self.lock:
            return "".join(self.text)

    def logged(self) -> int:
        return max(losses(self.output()), default=0)

    def wait_for_iteration(self, it: int, timeout: float = 300) -> bool:
        end = time.time() + timeout
        while time.time() < end and all(p.poll() is None for p in self.procs):
            if self.logged() >= it:
                return True
            time.sleep(0.01)
        return False

    def wait(self, timeout: float = 600) -> list[int]:
        try:
            rcs = [p.wait(timeout=timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            os.killpg(self.procs[0].pid, signal.SIGKILL)
            rcs = [p.wait() for p in self.procs]
        time.sleep(0.2)  # the reader threads drain the pipes
        return rcs


def torchrun_cmd(nproc: int, flags: list[str], restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "pretrain_gpt.py", *BASE, *flags]


def rank_jobs(nproc: int, flags: list[str]) -> Job:
    """The ranks started one process each, as srun starts them (torch.distributed's env:// variables)."""
    port = free_port()
    envs = [dict(env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(nproc)]
    cmd = [sys.executable, "pretrain_gpt.py", *BASE, *flags]
    return Job([cmd] * nproc, envs)


def worker_pids(agent_pid: int) -> dict:
    """{rank: pid} of torchrun's workers (children of the agent whose environment names a RANK)."""
    out = {}
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):
            continue
        if int(fields[1]) == agent_pid:
            children.append(stat.parent.name)
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(pid)
    return out


def reference(layout: str) -> dict:
    nproc, extra = LAYOUTS[layout]
    job = Job([torchrun_cmd(nproc, extra)], [env()])
    rcs = job.wait()
    ref = {it: values.pop() for it, values in losses(job.output()).items()}
    if rcs != [0] or sorted(ref) != list(range(1, ITERS + 1)):
        raise SystemExit(f"reference run of {layout} failed:\n{job.output()[-3000:]}")
    return ref


def wait_for_partial(ck: Path, timeout: float = 60) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if any(ck.glob(".iter_*.partial")):
            return True
        time.sleep(0.0005)
    return False


def kill_trial(rng: random.Random, layout: str, ref: dict, workdir: Path, n: int, rank: int) -> dict:
    nproc, extra = LAYOUTS[layout]
    ck = workdir / f"kill{n}"
    after, mid_save = rng.randint(1, ITERS - 2), rng.random() < 0.5
    job = Job([torchrun_cmd(nproc, extra + ["--save", str(ck), "--load", str(ck)], restarts=1)], [env()])
    trial = {"kind": "kill-9", "layout": layout, "rank": rank, "after_iteration": after,
             "point": "mid-save" if mid_save else "mid-step"}
    if job.wait_for_iteration(after):
        if mid_save:
            trial["save_caught"] = wait_for_partial(ck)
        else:
            time.sleep(rng.uniform(0.0, 0.3))
        pids = worker_pids(job.procs[0].pid)
        trial["killed_at_iteration"] = job.logged()
        trial["killed_pid_found"] = rank in pids
        if rank in pids:
            os.kill(pids[rank], signal.SIGKILL)
    rcs = job.wait()
    got = losses(job.output())
    starts = job.output().count(" parameters per rank, ")  # one line per start of the workers
    trial.update(restarted=starts >= 2, resumed_from_checkpoint=" resumed from " in job.output(), exit=rcs[0],
                 last_iteration=max(got, default=0))
    trial["resumed"] = rcs == [0] and trial["last_iteration"] == ITERS and trial["restarted"]  # (from scratch
    # when the kill came before the first complete save)
    trial["identical"] = trial["resumed"] and identical(got, ref)
    if not trial["identical"]:
        trial["tail"] = job.output()[-2000:]
    return trial


def kill_rank(n: int, layout: str) -> int:
    """The rank killed in kill trial ``n``: each layout's trials take its ranks in turn (0, 1, 0, 1, ...),
    so every rank is killed (a random draw can miss one: the record before this drew rank 0 alone for
    some layouts), whatever the number of trials."""
    return (n // len(LAYOUTS)) % LAYOUTS[layout][0]


def sigterm_trial(rng: random.Random, layout: str, ref: dict, workdir: Path, n: int) -> dict:
    nproc, extra = LAYOUTS[layout]
    ck = workdir / f"term{n}"
    flags = extra + ["--save", str(ck), "--load", str(ck), "--num-workers", "2"]
    after = rng.randint(1, ITERS - 2)
    job = rank_jobs(nproc, flags)
    trial = {"kind": "SIGTERM", "layout": layout, "after_iteration": after}
    if job.wait_for_iteration(after):
        time.sleep(rng.uniform(0.0, 0.2))
        os.killpg(job.procs[0].pid, signal.SIGTERM)  # every rank and every DataLoader worker
    rcs = job.wait()
    first = losses(job.output())
    marker = ck / "latest_checkpointed_iteration.txt"
    latest = int(marker.read_text()) if marker.is_file() else None
    trial.update(exits=rcs, stopped_at=max(first, default=0), checkpoint=latest)
    trial["saved_current"] = latest is not None and latest == trial["stopped_at"]
    trial["exit_0_every_rank"] = all(rc == 0 for rc in rcs) and "Traceback" not in job.output()
    resume = rank_jobs(nproc, flags)
    rrcs = resume.wait()
    got = losses(resume.output())
    trial["resumed"] = all(rc == 0 for rc in rrcs) and max(got, default=0) == ITERS
    trial["identical"] = trial["resumed"] and identical(first, ref) and identical(got, ref)
    if not (trial["identical"] and trial["saved_current"] and trial["exit_0_every_rank"]):
        trial["tail"] = (job.output() + resume.output())[-2000:]
    return trial


def summary(trials: list[dict]) -> dict:
    kills = [t for t in trials if t["kind"] == "kill-9"]
    terms = [t for t in trials if t["kind"] == "SIGTERM"]
    return {"kill-9": {"trials": len(kills), "resumed": sum(t["resumed"] for t in kills),
                       "killed per rank": {str(r): sum(t["rank"] == r for t in kills)
                                           for r in sorted({t["rank"] for t in kills})},
                       "identical": sum(t["identical"] for t in kills),
                       "mid-save": sum(t["point"] == "mid-save" for t in kills),
                       "mid-save caught (partial directory seen)": sum(bool(t.get("save_caught")) for t in kills)},
            "SIGTERM": {"trials": len(terms), "checkpoint at the current iteration": sum(t["saved_current"] for t in terms),
                        "exit 0 on every rank": sum(t["exit_0_every_rank"] for t in terms),
                        "resumed": sum(t["resumed"] for t in terms), "identical": sum(t["identical"] for t in terms)}}


def report(trial: dict) -> None:
    print(json.dumps({k: v for k, v in trial.items() if k != "tail"}), flush=True)
    if "tail" in trial:
        print("--- output tail of that trial ---\n" + trial["tail"] + "\n---", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-trials", type=int, default=20)
    ap.add_argument("--sigterm-trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--record-dir", default=None, help="write a JSON record here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.time()
    refs = {name: reference(name) for name in LAYOUTS}
    trials = []
    with tempfile.TemporaryDirectory(prefix="paratron_reliability_") as tmp:
        for n in range(args.kill_trials):
            layout = list(LAYOUTS)[n % len(LAYOUTS)]
            trials.append(kill_trial(rng, layout, refs[layout], Path(tmp), n, kill_rank(n, layout)))
            report(trials[-1])
        for n in range(args.sigterm_trials):
            layout = list(LAYOUTS)[n % len(LAYOUTS)]
            trials.append(sigterm_trial(rng, layout, refs[layout], Path(tmp), n))
            report(trials[-1])
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "seed": args.seed,
              "seconds": round(time.time() - t0), "summary": summary(trials), "trials": trials}
    print(json.dumps(result["summary"], indent=1))
    if args.record_dir:
        import torch
        result.update(torch=torch.__version__, hardware="CPU (gloo)", commit=_commit())
        path = Path(args.record_dir) / f"reliability_cpu_{time.strftime('%Y%m%d_%H%M%S', time.gmtime())}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"record: {path}")


def _commit() -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import commit  # $PARATRON_COMMIT on a copy without git history
    return commit()


if __name__ == "__main__":
    main()
