"""The server's generation thread over the paged engine (``paratron serve --inference-dynamic-batching``).

The thread takes submitted jobs (an HTTP request's prompts: batcher.Job) between two engine steps, queues their
requests in the engine, and runs one step after another while any request waits or runs: each step's tokens go
to the streaming jobs, each finished request's result to its job, a job's answer when all its requests are
done. It has ``submit`` / ``stop`` / ``alive`` / ``batches`` as batcher.Batcher has (``batches``: engine steps).
"""
from __future__ import annotations

import queue
import threading

from .batcher import Job, step_all
from .paged import PagedEngine


class PagedBatcher:
    def __init__(self, engine: PagedEngine):
        self.engine = engine
        self.queue: queue.Queue = queue.Queue()
        self.results: dict = {}  # job -> its results so far
        self.tokens: dict = {}  # streaming job -> this step's token lists (one token per request in each)
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="paratron-paged", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def batches(self) -> int:
        return self.engine.steps

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _take(self, block: bool) -> None:
        """Queue the submitted jobs' requests in the engine (waiting for the first when ``block``)."""
        while True:
            try:
                job = self.queue.get() if block else self.queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:
                self.stopping = True
                continue
            problem = next((p for p in map(self.engine.check, job.requests) if p), None)
            if problem:
                job.fail(ValueError(problem))
                continue
            self.results[job] = [None] * len(job.requests)
            for k, req in enumerate(job.requests):
                seq = self.engine.add(req, owner=(job, k))
                if seq.done:
                    self._done(seq)

    def _done(self, seq) -> None:
        job, k = seq.owner
        self.results[job][k] = self.engine.result(seq)
        if all(r is not None for r in self.results[job]):
            job.finish(self.results.pop(job))

    def _on_token(self, seq, token) -> None:
        job, k = seq.owner
        if job.steps is not None:  # (a speculative step keeps several tokens of a request: one list each)
            steps = self.tokens.get(job)
            if steps is None:
                steps = self.tokens[job] = [[None] * len(job.requests)]
            elif steps[-1][k] is not None:
                steps.append([None] * len(job.requests))
            steps[-1][k] = token

    def _loop(self) -> None:
        while not (self.stopping and self.engine.idle):
            self._take(block=self.engine.idle and not self.stopping)
            if self.engine.idle:
                continue
            try:
                finished = self.engine.step(self._on_token)
            except Exception as err:  # noqa: BLE001 - every request in flight fails (a 500), the thread goes on
                self.engine.abort()
                self.tokens.clear()
                for job in list(self.results):
                    job.fail(err)
                self.results.clear()
                continue
            # (every job of a server shares its event loop)
            step_all([(job, step) for job, steps in self.tokens.items() for step in steps])
            self.tokens.clear()
            for seq in finished:
                self._done(seq)
        while True:  # submitted after the stop: refused
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.fail(RuntimeError("the server is shutting down"))
