"""Speculative decoding in the paged engine (``--inference-dynamic-batching --num-speculative-tokens K``): each
decoding request drafts up to K tokens with the model's multi-token prediction (MTP) depths and verifies them in
the step's one packed pass, beside the other requests' prompt chunks.

* **Scheduling** (:class:`SpecScheduler`). Decodes are scheduled first as without speculation (one token each,
  preempting when a block is missing); then each decode is given k <= K drafts within what is left of the
  token budget, its ``max_new_tokens`` (k <= tokens left - 1) and the free blocks (drafts never preempt):
  it contributes k + 1 query tokens ``[t, d_1 .. d_k]`` like a small prefill chunk. Prefills and admissions
  take the rest of the budget.
* **Drafting** (:meth:`SpeculativePagedEngine._draft`). Each depth has its own paged pool (:class:`DepthPool`)
  read through the request's block table, as the main layers' are. A request keeps the main model's hidden
  states of its positions whose depth entries are not yet final (its *window*: the prompt's after prefill,
  then the last K - 1 positions and the ones verified since); depth 1 runs over the window with the next
  tokens' embeddings, depth d over depth d - 1's output and the tokens d ahead (drafts where not yet known),
  as in the fixed-batch engine (speculative.py). The windows of every drafting request are packed into one
  pass per depth; the last position of each gives its draft (``speculative.draft_token``).
* **Verification and acceptance.** The main model's pass writes the k + 1 tokens' keys and values and gives
  their logits; ``speculative.accept`` keeps the longest matching prefix (greedy) or applies the rejection rule
  (sampling), per group of requests with the same k. Kept tokens go through the engine's ``_record`` one by
  one (stop conditions, max tokens, log-probabilities, streaming callbacks as without speculation).
* **Rollback.** The request's length becomes its old length + accepted + 1: the keys and values of rejected
  positions stay in its last block until the next step overwrites them (attention never reads past a
  token's own position), blocks past the new length go back to the allocator, and the prefix cache only
  registers full blocks of computed (so accepted) tokens.

* **Tensor parallelism.** Every rank runs the same step over its share of the KV heads (of the main layers and
  of each depth's pool): the same schedule, drafting passes, verification and acceptance. The logits are
  gathered over TP, and the decisions that steer the scheduler are rank 0's, broadcast: each depth's drafts
  (before the next depth reads them) and each group's accepted counts and following tokens, as the first
  tokens after a prompt are (PagedEngine._sample). Seeded requests draw alike on every rank (same generator,
  same draws), so their generators stay in step.

Refused by name: hybrid models (their recurrent states cannot roll back). Speculative steps run uncaptured (no
CUDA graphs).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch

from ..errors import ConfigError
from ..model.layers import ForwardContext
from .engine import Engine
from .paged import PagedEngine, log_probs
from .paged_cache import PagedKVCache
from .scheduler import Scheduler, Seq
from .speculative import Acceptance, accept, depth_layer, draft_token


def build_paged(engine: Engine, cfg, group=None) -> PagedEngine:
    """The paged engine for ``engine``: speculative when ``engine.num_speculative_tokens`` > 0; its steps
    asynchronous with --inference-dynamic-batching-async-sched-mode async (paged_async.py, which refuses speculation)."""
    if cfg.inference_dynamic_batching_async_sched_mode == "async":
        from .paged_async import AsyncPagedEngine
        return AsyncPagedEngine(engine, cfg, group)
    if engine.num_speculative_tokens:
        return SpeculativePagedEngine(engine, cfg, group)
    return PagedEngine(engine, cfg, group)


class DepthPool:
    """The keys and values of one MTP depth, paged like the main layers' (same block tables and slots): the
    ``cache`` of a PagedView for that depth's layer, whatever its layer index."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def depth_pools(model, num_blocks: int, block_size: int, depths: int, device, dtype) -> list[DepthPool]:
    """One pool per depth, shaped as a main layer's (multi-latent attention: one latent row per token)."""
    shape = (num_blocks, block_size, *PagedKVCache.row_shape(model))
    pools = []
    for _ in range(depths):
        k = torch.zeros(shape, device=device, dtype=dtype)
        pools.append(DepthPool(k, k if model.config.multi_latent_attention else torch.zeros_like(k)))
    return pools


class SpecScheduler(Scheduler):
    """The paged scheduler whose decodes also take drafts: ``drafts`` {seq id: k} of the last schedule's decodes."""

    def __init__(self, blocks, max_requests: int, max_tokens: int, chunked: bool, k: int):
        super().__init__(blocks, max_requests, max_tokens, chunked)
        self.k = k
        self.drafts: dict = {}

    def _decodes(self, plan: list, budget: int) -> int:
        start = len(plan)
        budget = super()._decodes(plan, budget)
        self.drafts = {}
        for i in range(start, len(plan)):
            seq, _ = plan[i]
            k = max(0, min(self.k, budget, seq.new_max - len(seq.generated) - 1))
            while k > 0 and self.blocks_for(seq, seq.computed + 1 + k) > self.blocks.available:
                k -= 1
            if k and self._grow(seq, seq.computed + 1 + k):
                plan[i] = (seq, 1 + k)
                budget -= k
            self.drafts[seq.id] = plan[i][1] - 1
        return budget


def refusal(engine: Engine) -> Optional[str]:
    """Why the paged engine cannot speculate for ``engine``'s model (one line), or None."""
    k = engine.num_speculative_tokens
    if PagedKVCache.recurrent(engine.model):
        return (f"--num-speculative-tokens {k} with --inference-dynamic-batching: the Mamba-2 / Gated DeltaNet "
                "states of a hybrid model cannot roll back rejected drafts (serve it without speculation)")
    return None


class SpeculativePagedEngine(PagedEngine):
    """The paged engine with drafts from the MTP depths (module docstring); ``acceptance`` counts them."""

    def __init__(self, engine: Engine, cfg, group=None):
        problem = refusal(engine)
        if problem:
            raise ConfigError(problem)
        super().__init__(engine, cfg, group)
        self.k = engine.num_speculative_tokens
        self.sched = SpecScheduler(self.blocks, cfg.inference_dynamic_batching_max_requests,
                                   cfg.inference_dynamic_batching_max_tokens, cfg.enable_chunked_prefill, self.k)
        self.graphs = self.mixed = None  # speculative steps run uncaptured and uncompiled
        dtype = next(engine.model.parameters()).dtype
        self.depths = depth_pools(engine.model, self.num_blocks, self.block_size, self.k, self.device, dtype)
        self.windows: dict = {}  # seq id -> (its window's first position, the main model's hidden states [w, h])
        self.acceptance = Acceptance()

    @staticmethod
    def extra_pool_layers(engine: Engine) -> int:
        """One pool per drafted depth, beside the main layers' (the GPU's pool is sized for them all)."""
        return engine.num_speculative_tokens

    def abort(self) -> None:
        super().abort()
        self.windows.clear()

    # ---- one step ---------------------------------------------------------------------------
    def _advance(self, plan: list, on_token) -> list[Seq]:
        """As PagedEngine._advance, decodes verifying their drafts (module docstring)."""
        decoding = [seq for seq, _ in plan if seq.id in self.sched.drafts]
        proposed, q = self._draft([(seq, self.sched.drafts[seq.id]) for seq in decoding])
        plan = [(seq, 1 + len(proposed.get(seq.id, ()))) if seq.id in self.sched.drafts else (seq, n)
                for seq, n in plan]
        for seq in decoding:  # the drafts sit after the last token for the pass's packing, then go again
            seq.tokens += proposed.get(seq.id, [])
        hidden, logits, picks, offsets = self._verify(plan)
        for seq in decoding:
            del seq.tokens[seq.computed + 1:]
        prefills = [(seq, n) for seq, n in plan if seq.id not in self.sched.drafts]
        finished = self._prefilled(prefills, hidden, logits, picks, offsets, on_token)
        return finished + self._accept(decoding, proposed, q, hidden, logits, picks, offsets, on_token)

    def _tiles(self, plan: list, extra: int = 0):
        """None: the speculative passes lay their tokens out themselves (drafts after each request's last token),
        so they attend a token per program."""
        return None

    def _release(self, s: Seq) -> None:
        super()._release(s)
        self.windows.pop(s.id, None)

    def _verify(self, plan: list) -> tuple:
        """The main model over the step's packed tokens: (hidden states [n, h], logits of the picked positions,
        {seq id: their rows}, {seq id: its first token's place in the pack}). A decode's every position is picked."""
        ids, pos, slots, rows, lengths, _, _ = self._pack(plan)
        pick, picks, offsets, base = [], {}, {}, 0
        for seq, n in plan:
            every = seq.id in self.sched.drafts or (seq.params.logprobs and seq.prompt_logprobs is None)
            mine = list(range(base, base + n)) if every else [base + n - 1]
            picks[seq.id] = list(range(len(pick), len(pick) + len(mine)))
            offsets[seq.id] = base
            pick += mine
            base += n
        t = self._tensor
        hidden = self.e.hidden(t([ids]), t([pos]), self._view(plan, slots, rows, lengths), None)[:, 0]
        return hidden, self.e.logits(hidden.index_select(0, t(pick))[:, None])[0], picks, offsets

    def _extend(self, seq: Seq, at: int, hidden: torch.Tensor) -> None:
        """Append the main model's ``hidden`` states of positions ``at`` .. to ``seq``'s window (a new window
        when it does not end at ``at``: a request computed again after a preemption)."""
        start, window = self.windows.get(seq.id, (at, None))
        if window is None or start + len(window) != at:
            start, window = at, hidden
        else:
            window = torch.cat([window, hidden])
        self.windows[seq.id] = (start, window)

    def _prefilled(self, prefills: list, hidden, logits, picks, offsets, on_token) -> list[Seq]:
        """The prompt chunks' bookkeeping and first tokens (as PagedEngine.step); the requests that finished."""
        for seq, n in prefills:
            self._extend(seq, seq.computed, hidden[offsets[seq.id]:offsets[seq.id] + n])
            seq.computed += n
            self.sched.register_full(seq)
        return self._next_tokens(prefills, logits, picks, on_token)

    # ---- drafting ---------------------------------------------------------------------------
    def _draft(self, wanted: list) -> tuple[dict, dict]:
        """({seq id: its drafts}, {seq id: their distributions [k, vocab]} when any row samples) of the decodes
        ``wanted`` [(seq, k)] with k > 0 and a window that ends at their last computed position."""
        seqs, ks = [], []
        for seq, k in wanted:
            start, window = self.windows.get(seq.id, (0, None))
            if k and window is not None and start + len(window) == seq.computed:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return {}, {}
        tokens, qs = self._depths(seqs)
        for seq in seqs:  # every depth's entry of positions <= computed - K is final: out of the window
            start, window = self.windows[seq.id]
            keep = max(0, min(len(window), self.k - 1))
            self.windows[seq.id] = (start + len(window) - keep, window[len(window) - keep:])
        proposed = {s.id: tokens[i][:k] for i, (s, k) in enumerate(zip(seqs, ks))}
        q = {s.id: qs[i, :k] for i, (s, k) in enumerate(zip(seqs, ks))} if qs is not None else {}
        return proposed, q

    def _depths(self, seqs: list[Seq]) -> tuple[list, Optional[torch.Tensor]]:
        """K drafts of each of ``seqs`` ([row][depth]) and their distributions [rows, K, vocab] (None: all greedy):
        every depth runs over every window, packed into one pass per depth."""
        m, t = self.e.model, self._tensor
        bs, pos, slots, rows, lasts, hidden = self.block_size, [], [], [], [], []
        for r, seq in enumerate(seqs):
            start, window = self.windows[seq.id]
            at = range(start, start + len(window))
            pos += at
            slots += [seq.blocks[p // bs] * bs + p % bs for p in at]
            rows += [r] * len(window)
            lasts.append(len(pos) - 1)
            hidden.append(window)
        view = self._view([(s, 0) for s in seqs], slots, rows, [p + 1 for p in pos])
        x, lasts, positions = torch.cat(hidden)[:, None], t(lasts), t([pos])
        rope = m.rotary(len(pos), positions) if m.rotary is not None else None
        streams = [list(s.tokens) for s in seqs]
        sampler, owner = self._sampler(seqs), [r for r, s in enumerate(seqs) for _ in self.windows[s.id][1]]
        drafts, qs = [], []
        for depth in range(1, self.k + 1):
            ids = t([[streams[r][p + depth] for r, p in zip(owner, pos)]])
            ahead = (positions + depth).clamp(max=self.e.context - 1)  # (drafts past the context are never kept)
            ctx = ForwardContext(rope=rope, mask=None, causal=False,
                                 kv_cache=dataclasses.replace(view, cache=self.depths[depth - 1]))
            x = depth_layer(m, depth)(x, m.embedding(ids, ahead), ctx)
            token, q = draft_token(self.e, sampler, self.e.logits(x.index_select(0, lasts))[0])
            if q is None:  # (sampled drafts are broadcast already) every TP rank goes on with rank 0's
                token = self.e._broadcast(token)
            for stream, d in zip(streams, token.tolist()):
                stream.append(d)
            drafts.append(token)
            if q is not None:
                qs.append(q)
        return torch.stack(drafts, 1).tolist(), (torch.stack(qs, 1) if qs else None)

    # ---- acceptance -------------------------------------------------------------------------
    def _accept(self, decoding, proposed, q, hidden, logits, picks, offsets, on_token) -> list[Seq]:
        """Accept each decode's drafts (groups of the same draft count); the requests that finished."""
        groups = collections.defaultdict(list)
        for seq in decoding:
            groups[len(proposed.get(seq.id, ()))].append(seq)
        finished = []
        for k, seqs in groups.items():
            sampler = self._sampler(seqs)
            rows = torch.stack([logits[picks[s.id]] for s in seqs])  # [b, k + 1, vocab]
            drafts = torch.tensor([proposed.get(s.id, []) for s in seqs], dtype=torch.long,
                                  device=self.device).view(len(seqs), k)
            dq = torch.stack([q[s.id] for s in seqs]) if k and not sampler.greedy else None
            a, x = self.e._broadcast(torch.stack(accept(sampler, rows, drafts, dq))).unbind(0)  # rank 0's, on all
            for s, ai, xi, lg in zip(seqs, a.tolist(), x.tolist(), rows):
                self.acceptance.add(Acceptance(drafted=k, accepted=ai, steps=1, tokens=ai + 1))
                self._keep(s, proposed.get(s.id, [])[:ai] + [xi], lg, on_token)
                if s.done:
                    finished.append(s)
                    continue
                self._extend(s, s.computed, hidden[offsets[s.id]:offsets[s.id] + ai + 1])
                s.computed += ai + 1
                self._roll_back(s)
        return finished

    def _keep(self, s: Seq, chosen: list, logits: torch.Tensor, on_token) -> None:
        """Record ``chosen`` (row i predicted by ``logits[i]``) for ``s`` until one ends it."""
        lp = top = None
        if s.params.logprobs:
            lp, top = log_probs(logits[:len(chosen)], chosen, s.params.top_logprobs)
        for i, t in enumerate(chosen):
            got = self._record(s, t, None if lp is None else lp[i], None if top is None else top[i])
            if on_token is not None:
                on_token(s, got)
            if s.done:
                return

    def _roll_back(self, s: Seq) -> None:
        """Give back the blocks past ``s``'s computed tokens (rejected drafts' slots) and offer its full blocks to
        the prefix cache (computed tokens only: accepted ones)."""
        keep = -(-s.computed // self.block_size)
        if len(s.blocks) > keep:
            self.blocks.release(s.blocks[keep:])
            del s.blocks[keep:]
            self.tables.truncate(s, keep)
        self.sched.register_full(s)

    def startup_line(self) -> str:
        return (super().startup_line() + f", speculative decoding: up to {self.k} drafts per decode from the MTP "
                "depths (steps run uncaptured)")

    def stats(self) -> dict:
        a = self.acceptance
        return {**super().stats(), "speculative_drafted": a.drafted, "speculative_accepted": a.accepted,
                "speculative_acceptance_rate": a.rate, "speculative_tokens_per_step": a.tokens_per_step}
