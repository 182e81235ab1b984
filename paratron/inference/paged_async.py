"""``--inference-dynamic-batching-async-sched-mode async``: the paged engine schedules step n+1 while the device runs step n.

The plain engine reads each step's tokens back before it schedules the next, so the device idles while the host
records tokens, checks stop conditions, schedules and packs. Here a step is launched (its pass and its tokens
chosen, on the device, copied to pinned host memory behind an event) and only then is the previous step's copy
read. A request whose token of step n is not yet known when step n+1 is scheduled holds a placeholder in its
tokens; step n+1's packed ids take it from step n's token tensor on the device (an index copy, no host read).
Reading step n back gives the placeholders their values, records the tokens, checks stop conditions and releases
the finished requests' blocks (the device runs steps in order on one stream, so a block released while step n+1
still reads it is written by a later step only). A request that stopped at step n (end of document, a stop
string) has run one more token in step n+1, dropped; a request whose token is its last by ``max_tokens`` gets no
placeholder and is not scheduled again. Tokens reach ``on_token`` a step later than the plain engine's.
Steps run as the plain engine's (the previous step read back first) while any request wants log-probabilities.
Greedy and seeded outputs equal the plain engine's (tests/unit/test_paged_async.py). Not with tensor parallelism,
speculative decoding or recurrent layers (refused by name).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from .paged import PagedEngine

PLACEHOLDER = -1  # a token chosen on the device and not yet read back


@dataclass
class Launched:
    """A step whose tokens were chosen on the device: ``entries`` [(request, the position of its placeholder in
    its tokens, None for its last token)], one per row of ``tokens``; ``host``: their pinned copy, complete once
    ``event`` has passed (None on a CPU); ``plan``: the step's (request, tokens computed)."""
    plan: list
    entries: list
    tokens: Optional[torch.Tensor]
    host: Optional[torch.Tensor]
    event: Optional[torch.cuda.Event]

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return [] if self.host is None else self.host.tolist()


def refusal(engine: PagedEngine) -> Optional[str]:
    """Why the engine cannot run its steps asynchronously (None: it can)."""
    why = ("tensor parallelism (the ranks keep rank 0's tokens each step)" if engine.group is not None else
           "speculative decoding" if engine.e.num_speculative_tokens else
           "Mamba-2 / Gated DeltaNet layers (their states advance with each token read)" if engine.states is not None
           else None)
    return None if why is None else f"--inference-dynamic-batching-async-sched-mode async: not with {why}; use legacy"


class AsyncPagedEngine(PagedEngine):
    """The paged engine with each step's host work overlapped with the previous step's device work."""

    def __init__(self, engine, cfg, group=None):
        super().__init__(engine, cfg, group)
        problem = refusal(self)
        if problem:
            raise ConfigError(problem)
        self.inflight: Optional[Launched] = None
        self.wanting_logprobs = 0  # requests added and not finished that want log-probabilities

    def add(self, req, owner=None):
        seq = super().add(req, owner)
        if req.params.logprobs and not seq.done:
            self.wanting_logprobs += 1
        return seq

    def _release(self, s) -> None:
        super()._release(s)
        if s.params.logprobs:
            self.wanting_logprobs -= 1

    def abort(self) -> None:
        self.inflight = None
        super().abort()
        self.wanting_logprobs = 0

    @torch.no_grad()
    def step(self, on_token: Optional[Callable] = None) -> list:
        if self.wanting_logprobs:  # the plain engine's step, the previous one read back first
            return self._complete(on_token) + super().step(on_token)
        start = time.perf_counter()
        plan = self.sched.schedule()
        launched = self._launch(plan) if plan else None
        finished = self._complete(on_token)
        self.inflight = launched
        if plan:
            self.steps += 1
        elif not finished and not self.idle:
            raise RuntimeError(f"the paged engine cannot schedule its {len(self.sched.waiting)} waiting requests")
        self._timed(plan, start)
        return finished

    def _launch(self, plan: list) -> Launched:
        """Run ``plan`` and choose its tokens on the device, without reading them."""
        logits, picks = self._run(plan, self._patch(plan, self.inflight))
        for seq, n in plan:
            seq.computed += n
        ready = [seq for seq, _ in plan if seq.computed == len(seq.tokens)]
        if not ready:  # prompt chunks only
            return Launched(plan, [], None, None, None)
        chosen = self._choose(ready, self._last_logits(ready, logits, picks))
        host, event = chosen, None
        if chosen.is_cuda:
            host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            host.copy_(chosen, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        entries = []
        for s in ready:
            if len(s.generated) + s.unresolved + 1 >= s.new_max:  # its last token by count: nothing after it
                entries.append((s, None))
            else:
                s.tokens.append(PLACEHOLDER)
                s.unresolved += 1
                entries.append((s, len(s.tokens) - 1))
        return Launched(plan, entries, chosen, host, event)

    def _patch(self, plan: list, prev: Optional[Launched]) -> Optional[Callable]:
        """What writes the previous step's tokens, on the device, where ``plan``'s packed ids hold placeholders."""
        if prev is None or prev.tokens is None:
            return None
        row = {s.id: i for i, (s, _) in enumerate(prev.entries)}
        at, src, base = [], [], 0
        for seq, n in plan:
            if seq.unresolved:
                for q in range(seq.computed, seq.computed + n):
                    if seq.tokens[q] == PLACEHOLDER:
                        at.append(base + q - seq.computed)
                        src.append(row[seq.id])
            base += n
        if not at:
            return None
        at_t, src_t, tokens = self._tensor(at), self._tensor(src), prev.tokens
        return lambda ids: ids.index_copy_(0, at_t, tokens.index_select(0, src_t).to(ids.dtype))

    def _complete(self, on_token: Optional[Callable]) -> list:
        """Read the launched step's tokens back and record them; the requests that finished."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return []
        start = time.perf_counter()
        tokens = prev.read()
        self.wait_s += time.perf_counter() - start
        finished = []
        for (s, at), t in zip(prev.entries, tokens):
            if at is not None:
                s.tokens[at] = t
                s.unresolved -= 1
            if s.done:  # stopped at an earlier step: this token is dropped
                continue
            got = self._record(s, t, None, None, placed=at is not None)
            if on_token is not None:
                on_token(s, got)
            if s.done:
                finished.append(s)
        for seq, _ in prev.plan:
            if not seq.done:
                self.sched.register_full(seq)
        for s in finished:
            self._release(s)
        return finished
