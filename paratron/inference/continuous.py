"""Continuous batching for ``paratron serve --continuous-batching``: requests join a running batch
between two decode steps instead of waiting for its longest row.

A session is one engine batch (``_Run``) of ``max_batch`` rows (a power of two under
``--torch-compile``) whose KV cache holds ``HEADROOM`` times what its first requests need. Every
decode step writes the same cache slot ``t`` in every row (the engine's static shapes: one compiled
step and CUDA graph serve the whole session). A request joins in a free row (one whose request is
done) when its prompt fits before the slot (``L <= t``) and its new tokens after it
(``t + max_new_tokens <= capacity``): its prompt is written into that row at slots ``t - L .. t - 1``
(the row's padding becomes ``t - L``, so positions count from its first token), and its first token is
sampled at the next step with everyone else's. Requests join in arrival order; one that does not fit
yet holds the others back (no request starves), and when the session has no row left running the
waiting ones start a new session with a cache sized for them.

Results equal what each request would get generated alone (greedy, or seeded sampling: the seed
starts the row's own generator). Tensor parallelism is not supported here (the follower ranks would
have to mirror every join); the server refuses the flag at TP > 1.
"""
from __future__ import annotations

import collections
import queue
import time

import torch

from .batcher import Batcher, Job
from .engine import Engine, Request, _Run
from .sampling import SamplingParams

HEADROOM = 2  # the cache of a session holds twice what its first requests need, for those that join


class ContinuousBatcher(Batcher):
    """The server's generation thread (``Batcher``'s ``submit`` / ``stop`` / ``alive``), with requests
    joining running sessions. ``engine``: an :class:`Engine` at TP 1."""

    def __init__(self, engine: Engine, max_batch: int, wait: float):
        self.engine = engine
        self.rows = (1 << (max_batch - 1).bit_length()) if engine.compile else max_batch
        self.waiting: collections.deque = collections.deque()
        self.joined = 0  # requests that joined a running session (tests and /health read it)
        self.stopping = False
        super().__init__(None, max_batch, wait)

    # ---- the queue ----------------------------------------------------------------------------
    def _take(self, block: bool) -> None:
        """Move submitted jobs to ``waiting`` (blocking for the first when ``block``); checks each."""
        while True:
            try:
                job = self.queue.get(timeout=None) if block else self.queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:
                self.stopping = True
                return
            problem = next((p for p in map(self.engine.check, job.requests) if p), None)
            if problem or len(job.requests) > self.rows:
                job.fail(ValueError(problem or f"n: {len(job.requests)} prompts, the server batches {self.rows}"))
                continue
            self.waiting.append(job)

    def _loop(self) -> None:
        while not self.stopping:
            if not self.waiting:
                self._take(block=True)
                if not self.waiting:
                    continue
            deadline = time.monotonic() + self.wait  # let more arrive for the first batch, as Batcher does
            while time.monotonic() < deadline and sum(len(j.requests) for j in self.waiting) < self.rows:
                time.sleep(min(0.001, self.wait))
                self._take(block=False)
            try:
                _Session(self).run()
            except Exception:  # noqa: BLE001 - handed to each request of the session (run), the thread goes on
                pass
        for job in self.waiting:
            job.fail(RuntimeError("the server is shutting down"))


class _Session:
    """One engine batch and the jobs whose requests occupy its rows."""

    def __init__(self, batcher: ContinuousBatcher):
        self.b, self.e = batcher, batcher.engine
        first, rows = [], 0
        while batcher.waiting and rows + len(batcher.waiting[0].requests) <= batcher.rows:
            job = batcher.waiting.popleft()
            first.append(job)
            rows += len(job.requests)
        idle = Request([0], SamplingParams(max_new_tokens=0))
        requests = [r for job in first for r in job.requests] + [idle] * (batcher.rows - rows)
        self.run_ = _Run(self.e, requests, headroom=HEADROOM)
        self.owner: list = [None] * batcher.rows  # row -> (job, index of the request in the job)
        self.results: dict = {}  # job -> its results so far
        at = 0
        for job in first:
            self._own(job, range(at, at + len(job.requests)))
            at += len(job.requests)
        self.jobs = list(first)

    def _own(self, job: Job, rows) -> None:
        self.results[job] = [None] * len(job.requests)
        for k, row in enumerate(rows):
            self.owner[row] = (job, k)

    def _fits(self, job: Job, t: int, free: list) -> bool:
        cap = self.run_.capacity
        return len(job.requests) <= len(free) and all(
            len(r.prompt) <= t and t + r.params.max_new_tokens <= cap for r in job.requests)

    def _join(self, t: int) -> None:
        """Waiting jobs into free rows, in arrival order, while the first one fits."""
        self.b._take(block=False)
        free = [i for i, o in enumerate(self.owner) if o is None]
        while self.b.waiting and self._fits(self.b.waiting[0], t, free):
            job = self.b.waiting.popleft()
            rows, free = free[:len(job.requests)], free[len(job.requests):]
            for row, req in zip(rows, job.requests):
                self.run_.admit(row, req, t)
            self._own(job, rows)
            self.jobs.append(job)
            self.b.joined += len(job.requests)

    def _finish_rows(self) -> None:
        """Hand each finished row's result to its job; a job whose rows are all done gets its answer."""
        run = self.run_
        for row, o in enumerate(self.owner):
            if o is None or not run.done[row]:
                continue
            job, k = o
            self.results[job][k] = run.result(row)
            self.owner[row] = None
            if all(r is not None for r in self.results[job]):
                job.finish(self.results.pop(job))
                self.jobs.remove(job)

    def _stream(self, new: list) -> None:
        for job in self.jobs:
            if job.steps is not None:
                tokens = [None] * len(job.requests)
                for row, o in enumerate(self.owner):
                    if o is not None and o[0] is job:
                        tokens[o[1]] = new[row]
                job.step(tokens)

    @torch.no_grad()
    def run(self) -> None:
        run, e = self.run_, self.e
        self.b.batches += 1  # sessions started
        try:
            run.prefill()
            self._finish_rows()  # requests asking for no token
            t = run.length
            while True:
                self._join(t)
                if all(o is None for o in self.owner):
                    break
                tok = e._broadcast(run.sampler(run.last, e.argmax_of(run.last)))
                run._flush([run._outputs(tok)], self._stream)
                self._finish_rows()
                if all(o is None for o in self.owner):
                    continue  # nothing left to step: waiting requests may join at this slot
                if t >= run.capacity:  # every row's tokens were checked to fit when it joined
                    raise RuntimeError(f"continuous batching ran out of cache slots at {t}")
                run.last = e._step(tok[:, None], t)
                t += 1
        except Exception as err:
            for job in list(self.results):
                job.fail(err)
            raise
