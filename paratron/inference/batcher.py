"""Concurrent HTTP requests batched together: a queue feeding one generation thread.

Each HTTP request becomes a :class:`Job` (its prompts, and for streaming an asyncio queue of steps).
The worker thread takes the first waiting job, waits up to ``wait`` seconds for more, packs jobs
until ``max_batch`` prompts, and runs them as one batch (a job larger than ``max_batch`` runs
alone). Jobs arriving during a batch wait for the next one (static batching: a batch runs until its
longest row finishes). Results and streamed tokens are handed back to the event loop thread-safely.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Optional


class Steps:
    """A streaming job's steps (each a list of tokens, one per request; None: the end), put by the event loop's
    thread (handed over by ``call_soon_threadsafe``) and taken all at once by the response: a list and one
    waiter, not an asyncio.Queue's wake-up per item."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.waiter = loop, [], None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    async def _wait(self) -> None:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def take(self) -> list:
        """Every step queued so far (waiting for the first)."""
        await self._wait()
        items, self.items = self.items, []
        return items

    async def get(self):
        """The next step (waiting for it)."""
        await self._wait()
        return self.items.pop(0)


class Job:
    def __init__(self, requests: list, loop: asyncio.AbstractEventLoop, stream: bool = False):
        self.requests, self.loop = requests, loop
        self.future = loop.create_future()
        self.steps: Optional[Steps] = Steps(loop) if stream else None

    def _call(self, fn, *args) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def step(self, tokens: list) -> None:
        if self.steps is not None:
            self._call(self.steps.put_nowait, tokens)

    def _set(self, result=None, error: Optional[BaseException] = None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def finish(self, results: list) -> None:
        self._call(self._set, results)
        if self.steps is not None:
            self._call(self.steps.put_nowait, None)

    def fail(self, error: BaseException) -> None:
        self._call(self._set, None, error)
        if self.steps is not None:
            self._call(self.steps.put_nowait, None)


def step_all(pairs: list) -> None:
    """``job.step(tokens)`` for each (job, tokens) of one engine step, with one wake-up of their event loop
    instead of one per job (a step of hundreds of streaming requests woke the loop hundreds of times)."""
    if not pairs:
        return
    loop = pairs[0][0].loop
    if loop.is_closed():
        return

    def deliver():
        for job, tokens in pairs:
            job.steps.put_nowait(tokens)
    loop.call_soon_threadsafe(deliver)


class Batcher:
    """``submit(job)`` from the event loop; ``run(requests, on_step)`` (a TextModel's) in the worker."""

    def __init__(self, run, max_batch: int, wait: float):
        self.run_batch, self.max_batch, self.wait = run, max_batch, wait
        self.queue: queue.Queue = queue.Queue()
        self.carry: Optional[Job] = None
        self.batches = 0
        self.thread = threading.Thread(target=self._loop, name="paratron-generate", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _next_batch(self) -> Optional[list]:
        first, self.carry = (self.carry, None) if self.carry is not None else (self.queue.get(), None)
        if first is None:
            return None
        jobs, rows = [first], len(first.requests)
        deadline = time.monotonic() + self.wait
        while rows < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                job = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.queue.put(None)  # stop after this batch
                break
            if rows + len(job.requests) > self.max_batch:
                self.carry = job
                break
            jobs.append(job)
            rows += len(job.requests)
        return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                return
            self._run(jobs)

    def _run(self, jobs: list) -> None:
        requests = [r for job in jobs for r in job.requests]
        bounds, at = [], 0
        for job in jobs:
            bounds.append((job, at, at + len(job.requests)))
            at += len(job.requests)
        streaming = [(j, a, b) for j, a, b in bounds if j.steps is not None]

        def on_step(new: list) -> None:
            for job, a, b in streaming:
                job.step(new[a:b])
        try:
            results = self.run_batch(requests, on_step if streaming else None)
        except Exception as e:  # noqa: BLE001 - handed to each request (a 400 or 500 answer), the thread goes on
            for job in jobs:
                job.fail(e)
            return
        self.batches += 1
        for job, a, b in bounds:
            job.finish(results[a:b])
