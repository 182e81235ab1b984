"""The paged engine's scheduler: which tokens of which requests the next step computes.

Every step has a budget of ``max_tokens`` tokens (``--inference-dynamic-batching-max-tokens``) and at most
``max_requests`` requests. In order:

1. decodes: every running request whose prompt is in the cache feeds its last token (one each), in the order
   the requests were admitted. A request that needs a new block when none is free preempts the most recently
   admitted running request (its blocks are released, it goes back to the front of the queue with its tokens
   so far: they are computed again, as a prompt, when it is admitted again; its output does not change);
2. prefills: running requests whose prompt is not all in the cache get the next chunk of it;
3. admission: waiting requests, first come first served: the first that does not fit (no row, no tokens
   left in the budget, no blocks) stops the admission, so no request is overtaken. With prefix caching
   the full blocks of its prompt already cached are taken instead of computed.

Without chunked prefill (``--enable-chunked-prefill``) a prompt is prefilled whole in one step (it waits for
a step whose budget holds it); with it, a prompt takes what is left of the budget and goes on next step.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Optional

from .blocks import BlockAllocator, chain_keys


@dataclass(eq=False)
class Seq:
    """One request in the paged engine: its tokens so far (prompt, then generated) and its blocks. Compared by
    identity (``eq=False``): the field-wise equality a dataclass generates made every ``seq in running`` build
    and compare tuples of all fields, O(n^2) such comparisons a step at hundreds of running requests."""
    id: int
    request: Any  # engine.Request
    new_max: int  # tokens it may generate (max_new_tokens within the context)
    tokens: list = field(default_factory=list)
    computed: int = 0  # tokens whose keys / values are in the cache
    blocks: list = field(default_factory=list)
    keys: list = field(default_factory=list)  # prefix-cache keys of its full blocks, in order
    generated: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    prompt_acc: list = field(default_factory=list)  # prompt log-probabilities of the chunks computed so far
    done: bool = False
    reason: str = "length"
    generator: Any = None  # its own sampling generator (seeded sampling), kept across preemptions
    owner: Any = None  # the server's (job, index)
    preempted: int = 0
    unresolved: int = 0  # tokens chosen on the device and not yet read back (placeholders: paged_async.py)

    @property
    def params(self):
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def need(self) -> int:
        """Tokens not yet in the cache (1 while decoding)."""
        return len(self.tokens) - self.computed


class Scheduler:
    """The waiting queue, the running requests and the blocks they hold."""

    def __init__(self, blocks: BlockAllocator, max_requests: int, max_tokens: int, chunked: bool):
        self.blocks, self.max_requests, self.max_tokens, self.chunked = blocks, max_requests, max_tokens, chunked
        self.waiting: collections.deque = collections.deque()
        self.running: list[Seq] = []
        self.preemptions = 0
        self.prefix_hits = 0  # blocks of admitted requests found in the prefix cache

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def blocks_for(self, seq: Seq, upto: int) -> int:
        """Blocks ``seq`` needs beyond those it holds to keep ``upto`` tokens."""
        return max(0, -(-upto // self.blocks.block_size) - len(seq.blocks))

    def _grow(self, seq: Seq, upto: int) -> bool:
        extra = self.blocks_for(seq, upto)
        got = self.blocks.allocate(extra) if extra else []
        if got is None:
            return False
        seq.blocks.extend(got)
        return True

    def preempt(self, seq: Seq) -> None:
        """Release ``seq``'s blocks; it waits at the front of the queue to be computed again."""
        self.blocks.release(seq.blocks)
        seq.blocks, seq.keys, seq.computed = [], [], 0
        seq.preempted += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Seq) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # (preempted while its last token was being read back)
            self.waiting.remove(seq)

    def schedule(self) -> list[tuple[Seq, int]]:
        """The (request, tokens to compute) of the next step, in packing order; [] when there is nothing."""
        plan: list[tuple[Seq, int]] = []
        budget = self._decodes(plan, self.max_tokens)
        budget = self._prefills(plan, budget)
        self._admit(plan, budget)
        # prefills holding blocks that none can extend: free the last one (a request with nothing to compute is
        # waiting for its last token to be read back: paged_async.py)
        if not plan and any(s.need > 0 for s in self.running):
            self.preempt(self.running[-1])
            return self.schedule()
        return plan

    def _decodes(self, plan: list, budget: int) -> int:
        preempted: set = set()  # ids of the requests this pass preempted (running shrinks from its end)
        for seq in list(self.running):
            if id(seq) in preempted or seq.need != 1 or seq.computed < seq.prompt_len or budget < 1:
                continue
            while not self._grow(seq, seq.computed + 1):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.add(id(victim))
                if victim is seq:
                    break
            if id(seq) not in preempted:
                plan.append((seq, 1))
                budget -= 1
        return budget

    def _take(self, seq: Seq, budget: int) -> int:
        """Tokens of ``seq``'s prompt to compute this step within ``budget`` (0: none fit). A preempted request is
        recomputed in chunks even without chunked prefill (its prompt and tokens may exceed a step)."""
        chunked = self.chunked or seq.preempted > 0
        n = min(seq.need, budget) if chunked else (seq.need if seq.need <= budget else 0)
        while n > 0 and self.blocks_for(seq, seq.computed + n) > self.blocks.available:
            n = (self.blocks.available + len(seq.blocks)) * self.blocks.block_size - seq.computed if chunked else 0
        return max(n, 0)

    def _prefills(self, plan: list, budget: int) -> int:
        scheduled = {id(s) for s, _ in plan}
        for seq in self.running:
            if id(seq) in scheduled or budget < 1:
                continue
            n = self._take(seq, budget)
            if n and self._grow(seq, seq.computed + n):
                plan.append((seq, n))
                budget -= n
        return budget

    def _admit(self, plan: list, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_requests:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            n = self._take(seq, budget)
            if not n or not self._grow(seq, seq.computed + n):  # a waiting request holds no blocks
                self.blocks.release(seq.blocks)
                seq.blocks, seq.keys, seq.computed = [], [], 0
                break
            self.waiting.popleft()
            self.prefix_hits += len(seq.keys)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n

    def _reuse_prefix(self, seq: Seq) -> None:
        """Take the cached blocks of ``seq``'s leading full blocks (leaving at least one token to compute:
        its logits give the next token)."""
        if not self.blocks.prefix_caching or seq.params.logprobs:  # (its prompt's logits are all wanted)
            return
        full = (len(seq.tokens) - 1) // self.blocks.block_size
        keys = chain_keys(seq.tokens, self.blocks.block_size, full)
        found = self.blocks.lookup(keys)
        seq.blocks, seq.keys = list(found), keys[:len(found)]
        seq.computed = len(found) * self.blocks.block_size

    def register_full(self, seq: Seq) -> None:
        """Offer ``seq``'s newly filled blocks to the prefix cache."""
        if not self.blocks.prefix_caching:
            return
        full = min(seq.computed // self.blocks.block_size, len(seq.blocks))
        if full > len(seq.keys):
            start = seq.keys[-1] if seq.keys else b""
            more = chain_keys(seq.tokens[len(seq.keys) * self.blocks.block_size:], self.blocks.block_size,
                              full - len(seq.keys), start)
            for j, key in enumerate(more, len(seq.keys)):
                self.blocks.register(seq.blocks[j], key)
            seq.keys.extend(more)
