"""Speculative decoding from the model's own multi-token prediction depths (``--num-speculative-tokens K``,
Megatron's flag; checkpoints trained with ``--mtp-num-layers N >= K``).

Each step the MTP depths draft K tokens, the main model verifies them in one pass of K + 1 tokens, and the
step keeps the longest prefix the target agrees with, plus one token of the target's own:

* **Drafting.** Depth k (model/mtp.py) predicts the token k + 1 places ahead from the hidden state of depth
  k - 1 at a position and the embedding of the token k places ahead. With ``t`` the token the last step
  ended on, depth 1 takes the main model's hidden state at the last verified position and ``t``, and gives
  draft d_1; depth k takes depth k - 1's output and d_{k-1}. Each depth has its own KV cache (keyed
  ``num_layers + k - 1`` in cache.py), filled as in training from the committed tokens: every step each
  depth runs again over the last 2K verified positions (which hold this step's new ones and the K - 1 before
  them, whose entries used drafts the last time), so an entry that used a draft token is rewritten once the
  real token is known. After the prompt the window has a fixed size, 2K.
* **Verification.** ``[t, d_1 .. d_K]`` run through the main model at the next K + 1 cache slots; row i of
  its logits is the target distribution p_i of the token after them. A greedy row accepts d_i while it is
  the argmax of p_{i-1} (so its tokens are plain greedy decoding's, token for token). A sampled row (its
  temperature, top-k and top-p applied to both p and the draft distribution q) accepts d_i with probability
  min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection it draws from max(0, p - q) normalised (p if that
  is zero), and after K acceptances from p_K: the standard rule, under which every emitted token has the
  target's distribution.
* **Rollback.** The cache is rolled back by position: the batch advances by the fewest tokens any of its
  unfinished rows accepted (plus one), the slots after that are rewritten by the next step, and attention
  never reads past a query's own slot. A row that accepted more drops its extra tokens (greedy: it finds
  them again; sampled: each kept token still has the target's distribution). At batch 1 nothing is dropped.

* **Graphs.** The verification of K + 1 tokens and greedy drafting over the 2K-position window have fixed
  shapes (:class:`Steps`, kept by the engine per cache): with ``compile`` they are compiled and, on CUDA,
  replayed as CUDA graphs; the other passes (the first after the prompt, sampled drafting, the last steps
  with fewer drafts) run eagerly.

``Engine.acceptance`` holds the drafted and accepted counts of the last ``generate`` (rate = accepted /
drafted) and the mean tokens per row and verification pass. The paged engine (paged_spec.py) drafts through
:func:`depth_layer` and :func:`draft_token` over its own paged depth pools and accepts with :func:`accept`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..model.layers import ForwardContext
from .cache import CacheView
from .engine import SYNC_EVERY, _Run


@dataclass
class Acceptance:
    """Speculative decoding's counts over one ``generate`` (or several, added): drafts proposed and accepted,
    verification passes of a row and tokens they kept (unfinished rows only)."""
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    tokens: int = 0
    ahead: int = 0  # passes run ahead of the host (their counts read back in chunks: SpeculativeRun.run_ahead)

    def add(self, other: "Acceptance") -> None:
        for name in ("drafted", "accepted", "steps", "tokens", "ahead"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def check_speculative(model, k: int) -> None:
    """Raise ValueError when ``model`` cannot draft ``k`` tokens per step."""
    depths = model.config.mtp_num_layers or 0
    if k < 0:
        raise ValueError(f"--num-speculative-tokens must be >= 0 (got {k})")
    if not depths:
        raise ValueError(f"--num-speculative-tokens {k}: the model has no multi-token prediction depths (train it "
                         "with --mtp-num-layers N to draft with them)")
    if k > depths:
        raise ValueError(f"--num-speculative-tokens {k}: the model has {depths} multi-token prediction depth(s); "
                         f"draft at most {depths}")


class DepthView(CacheView):
    """The cache of one MTP depth (its layer writes under its own key: one layer may serve every depth)."""

    def __init__(self, cache, slots: torch.Tensor, key: int):
        super().__init__(cache, slots, cache.capacity)
        self.key = key

    def _buffers(self, index: int):
        return self.cache.layer(self.key)


def window_mask(cache, slots: torch.Tensor) -> torch.Tensor:
    """[b, 1, len(slots), capacity]: each query slot sees its row's real slots up to itself (a padding query
    only itself, so no softmax row is empty)."""
    keys = torch.arange(cache.capacity, device=slots.device)
    seen = (keys[None, None, :] >= cache.pad[:, None, None]) & (keys[None, None, :] <= slots[None, :, None])
    return (seen | (keys[None, :] == slots[:, None])[None])[:, None]


def draft(engine, sampler, hidden: torch.Tensor, slots: torch.Tensor, stream: torch.Tensor, k: int) -> tuple:
    """Drafts [b, k] and their distributions q [b, k, vocab] (None when every row is greedy) from the MTP
    depths run over ``slots`` (consecutive), ``hidden`` [len(slots), b, h] being the main model's states there;
    ``stream`` [b, >= slots[-1] + k + 1] holds each slot's token (the drafts are written into it)."""
    m, cache = engine.model, engine.cache
    mask, positions = window_mask(cache, slots), cache.positions(slots)
    rope = m.rotary(len(slots), positions) if m.rotary is not None else None
    drafts, qs = [], []
    for depth in range(1, k + 1):
        ahead = slots + depth
        embedded = m.embedding(stream[:, ahead], cache.positions(ahead))
        view = DepthView(cache, slots, m.config.num_layers + depth - 1)
        hidden = depth_layer(m, depth)(hidden, embedded, ForwardContext(rope=rope, mask=mask, causal=False,
                                                                         kv_cache=view))
        token, q = draft_token(engine, sampler, engine.logits(hidden[-1:])[:, 0])
        stream.index_copy_(1, slots[-1:] + depth + 1, token[:, None])
        drafts.append(token)
        if q is not None:
            qs.append(q)
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)


def depth_layer(model, depth: int):
    """The MTP layer that drafts at ``depth`` (1-based; one layer serves every depth with a repeated layer)."""
    return model.mtp.layers[(depth - 1) % len(model.mtp.layers)]


def draft_token(engine, sampler, logits: torch.Tensor) -> tuple:
    """(the draft of each row [b], its distribution q [b, vocab] or None when every row is greedy) from a depth's
    ``logits`` [b, vocab]: the fixed-batch and the paged engine draft alike."""
    token = sampler(logits)  # greedy: the argmax of logits gathered alike on every TP rank
    if sampler.greedy:
        return token, None
    return engine._broadcast(token), sampler.probs(logits)


def accept(sampler, logits: torch.Tensor, drafts: torch.Tensor, q: Optional[torch.Tensor]) -> tuple:
    """(accepted drafts a [b], the token after them x [b]) from the verification ``logits`` [b, k + 1, vocab]
    of [t, d_1 .. d_k] and ``drafts`` [b, k] drawn from ``q`` [b, k, vocab] (None: every row greedy or k = 0)."""
    b, k = drafts.shape
    best = logits.argmax(-1)  # [b, k + 1]
    ok = drafts == best[:, :k]
    rows = torch.arange(b, device=logits.device)
    if sampler.greedy:
        a = ok.long().cumprod(-1).sum(-1)
        return a, best[rows, a]
    p = torch.stack([sampler.probs(logits[:, i]) for i in range(k + 1)], 1)  # [b, k + 1, vocab]
    if k:  # sampled rows: accept d_i with probability min(1, p / q)
        p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_d = q.gather(-1, drafts[..., None])[..., 0]
        ok = torch.where(sampler.is_greedy[:, None], ok, sampler.uniform(k) * q_d < p_d)
    a = ok.long().cumprod(-1).sum(-1)  # leading acceptances
    target = p[rows, a]
    residual = target
    if k:  # after a rejection: max(0, p - q) normalised (p itself where that is all zero)
        q_next = torch.where((a < k)[:, None], q[rows, a.clamp(max=k - 1)], torch.zeros_like(target))
        residual = (target - q_next).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    return a, torch.where(sampler.is_greedy, best[rows, a], sampler.draw(residual))


def step_tokens(a: torch.Tensor, x: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Every row's tokens of a step [b, k + 1]: its ``a`` accepted drafts, then ``x``, repeated to the end."""
    at = torch.arange(drafts.shape[1] + 1, device=a.device)[None, :]
    return torch.where(at < a[:, None], torch.cat([drafts, x[:, None]], 1), x[:, None])


class Steps:
    """The fixed-shape passes of one batch size and cache, kept by the engine across ``generate`` calls: the
    verification of K + 1 tokens at a slot, and greedy drafting over a window of 2K positions; with ``compile``
    each is compiled and, on CUDA, replayed as a CUDA graph (graphs.DecodeRunner), else run as it is."""

    def __init__(self, engine, k: int):
        self.e, self.k, cache = engine, k, engine.cache
        b, dev = cache.batch, engine.device
        self.stream = torch.zeros(b, cache.capacity + k + 2, dtype=torch.long, device=dev)  # each slot's token
        self.greedy = None  # the all-greedy sampler the drafting pass was built with
        self.verifier = self.drafter = None
        if engine.compile:
            from .graphs import DecodeRunner
            switch, pdl = engine.model.kernels.kernel_decode_coordinate_descent, engine.decode_pdl()
            pdl = "off" if pdl == "auto" else pdl  # (auto: one-row steps; these passes take k + 1 tokens a row)
            self.verifier = _Runner(DecodeRunner(self.verify, b, dev, switch, pdl),
                                    torch.zeros(b, k + 1, dtype=torch.long, device=dev))
            h = engine.model.config.hidden_size
            dtype = next(engine.model.parameters()).dtype
            self.drafter = _Runner(DecodeRunner(self._draft, b, dev, switch, pdl),
                                   torch.zeros(2 * k, b, h, device=dev, dtype=dtype))

    def verify(self, tokens: torch.Tensor, slot: torch.Tensor) -> tuple:
        """(hidden [s, b, h], logits [b, s, vocab]) of ``tokens`` [b, s] written from cache slot ``slot`` (0-d)."""
        slots = slot + torch.arange(tokens.shape[1], device=tokens.device)
        return self._pass(tokens, slots)

    def _pass(self, tokens, slots) -> tuple:
        e = self.e
        hidden = e.hidden(tokens, e.cache.positions(slots), CacheView(e.cache, slots, e.cache.capacity),
                          window_mask(e.cache, slots))
        return hidden, e.logits(hidden)

    def _draft(self, window: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        slots = start + torch.arange(window.shape[0], device=window.device)
        return draft(self.e, self.greedy, window, slots, self.stream, self.k)[0]

    def run_verify(self, tokens: torch.Tensor, slot) -> tuple:
        """The verification pass of ``tokens`` [b, s] from cache slot ``slot`` (an int, or a 0-d device tensor that
        the host never reads)."""
        if self.verifier is not None and tokens.shape[1] == self.k + 1:
            return self.verifier(tokens, slot)
        return self.verify(tokens, torch.as_tensor(slot, device=tokens.device))

    def greedy_drafts(self, sampler, window: torch.Tensor, start) -> torch.Tensor:
        """Greedy drafts [b, K] by the fixed-shape pass over a window of 2K positions from slot ``start`` (an int or a
        0-d device tensor)."""
        self.greedy = self.greedy or sampler
        if self.drafter is not None:
            return self.drafter(window, start)
        return self._draft(window, torch.as_tensor(start, device=window.device))

    def run_draft(self, sampler, window: torch.Tensor, start: int, k: int) -> tuple:
        """Drafts [b, k] and q (as :func:`draft`) over the window starting at slot ``start``."""
        if sampler.greedy and k == self.k and len(window) == 2 * self.k:  # the fixed-shape pass
            return self.greedy_drafts(sampler, window, start), None
        slots = torch.arange(start, start + len(window), device=window.device)
        return draft(self.e, sampler, window, slots, self.stream, k)


class _Runner:
    """A DecodeRunner whose input is ``example``'s shape and dtype instead of one token per row."""

    def __init__(self, runner, example: torch.Tensor):
        runner.tokens = example
        self.runner = runner

    def __call__(self, x: torch.Tensor, slot: int):
        return self.runner(x, slot)


class SpeculativeRun(_Run):
    """One batch generated with speculative decoding (module docstring)."""

    def __init__(self, engine, requests):
        super().__init__(engine, requests)
        self.k = engine.num_speculative_tokens
        steps = engine.speculative_steps
        if steps is None or steps.stream.shape != (engine.cache.batch, engine.cache.capacity + self.k + 2):
            steps = engine.speculative_steps = Steps(engine, self.k)
        self.steps, self.stream = steps, steps.stream
        self.stream.zero_()
        self.stream[:, :self.length] = self.ids
        self.stats = engine.acceptance = Acceptance()
        self.window: Optional[torch.Tensor] = None  # the main model's hidden states the MTP depths run over next
        self.start = 0  # the slot of the window's first position

    def prefill(self) -> None:
        e = self.e
        slots = torch.arange(self.length, device=e.device)
        view = CacheView(e.cache, slots, self.length)
        self.window = e.hidden(self.ids, e.cache.positions(slots), view, e.cache.prefill_mask(self.length))
        self.took_prompt(e.logits(self.window if self.want_logprobs else self.window[-1:]))

    def decode(self, on_step) -> None:
        """Steps of draft, verify, accept until every row is done (``on_step`` called per kept token)."""
        e = self.e
        tok = e._broadcast(self.sampler(self.last))
        self._flush([self._outputs(tok)], on_step)
        n = self.length - 1  # the slot of the last token the main model has seen; tok goes to n + 1
        ahead = on_step is None and self.sampler.greedy and not self.want_logprobs and e.model.par.tp_size == 1 \
            and not any(p.stop for p in self.params)
        while not all(self.done):
            left = max(self.new_max[i] - len(self.tokens[i]) for i, d in enumerate(self.done) if not d)
            steps = min(SYNC_EVERY, left // (self.k + 1), (e.cache.capacity - 2 - self.k - n) // (self.k + 1) + 1)
            if ahead and len(self.window) == 2 * self.k and steps >= 1:
                tok, n = self.run_ahead(tok, n, steps)
                continue
            k = max(0, min(self.k, e.cache.capacity - 2 - n, left - 1))
            self.stream[:, n + 1] = tok
            drafts, q = torch.zeros(len(self.done), 0, dtype=torch.long, device=e.device), None
            if k:
                drafts, q = self.steps.run_draft(self.sampler, self.window, self.start, k)
            hidden, logits = self.steps.run_verify(torch.cat([tok[:, None], drafts], 1), n + 1)
            a, x = e._broadcast(torch.stack(accept(self.sampler, logits, drafts, q))).unbind(0)
            kept, chosen = self._keep(a, x, drafts, logits, on_step)
            tok = chosen[:, kept - 1]
            # the depths run again over the last 2K verified positions (at least the K - 1 before this step's)
            self.window = torch.cat([self.window, hidden[:kept]])[-2 * self.k:]
            self.stream[:, n + 2:n + 2 + kept] = chosen[:, :kept]
            n += kept
            self.start = n + 1 - len(self.window)

    def run_ahead(self, tok: torch.Tensor, n: int, steps: int) -> tuple:
        """``steps`` full speculative steps (K drafts each) with the slot, the kept counts, the window and the token
        stream on the device: nothing is read by the host until the end, when the kept tokens of every step are
        read at once and recorded (greedy rows, no per-token callback, log-probabilities or stop strings: the rows'
        ends are found when the tokens are read, as plain decoding does every SYNC_EVERY steps). The batch advances
        each step by the fewest tokens a row unfinished at the start accepted, plus one; the caller bounds
        ``steps`` so that neither the cache nor the longest row's budget is overrun even if every draft is
        accepted. Returns (the next token [b], the last slot the main model has seen)."""
        k, dev = self.k, self.e.device
        live = torch.tensor([not d for d in self.done], device=dev)
        at = torch.arange(k + 1, device=dev)
        span = torch.arange(2 * k, device=dev)
        slot = torch.tensor(n, device=dev)
        window, record = self.window, []
        for _ in range(steps):
            self.stream.index_copy_(1, (slot + 1).view(1), tok[:, None])
            drafts = self.steps.greedy_drafts(self.sampler, window, slot + 1 - 2 * k)
            hidden, logits = self.steps.run_verify(torch.cat([tok[:, None], drafts], 1), slot + 1)
            a, x = accept(self.sampler, logits, drafts, None)
            kept = torch.where(live, a, k).min() + 1
            chosen = step_tokens(a, x, drafts)
            tok = chosen.index_select(1, (kept - 1).view(1))[:, 0]
            window = torch.cat([window, hidden]).index_select(0, kept + span)  # the last 2K verified positions
            self.stream.index_copy_(1, slot + 2 + at, chosen)  # (slots past the kept ones are rewritten before read)
            slot = slot + kept
            record.append((kept, a, chosen))
        self.window = window
        kept_all = torch.stack([r[0] for r in record]).tolist()  # the one read of the chunk
        a_all = torch.stack([r[1] for r in record]).tolist()
        chosen_all = torch.stack([r[2] for r in record]).tolist()
        for kept, a, chosen in zip(kept_all, a_all, chosen_all):
            self._count(k, a, kept)
            self.stats.ahead += 1
            for j in range(kept):
                self._record([row[j] for row in chosen], None, None)
        n += sum(kept_all)
        self.start = n + 1 - len(self.window)
        return tok, n

    def _count(self, k: int, accepted: list, kept: int) -> None:
        """Add one verification pass of the rows still unfinished to the acceptance counts (``accepted``: each row's
        accepted drafts, ``kept``: the tokens the batch kept)."""
        live = [i for i, d in enumerate(self.done) if not d]
        self.stats.drafted += k * len(live)
        self.stats.accepted += sum(accepted[i] for i in live)
        self.stats.steps += len(live)
        self.stats.tokens += kept * len(live)

    def _keep(self, a: torch.Tensor, x: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor, on_step) -> tuple:
        """Record the tokens the batch keeps this step: the fewest any unfinished row accepted, plus one (row r's
        tokens are its accepted drafts, then x_r). Returns (how many, every row's tokens of the step [b, k + 1])."""
        live = [i for i, d in enumerate(self.done) if not d]
        accepted = a.tolist()
        kept = min(accepted[i] for i in live) + 1
        self._count(drafts.shape[1], accepted, kept)
        chosen = step_tokens(a, x, drafts)
        pending = []
        for i in range(kept):  # token i of the step was predicted by row i of the verification
            self.last = logits[:, i]
            pending.append(self._outputs(chosen[:, i]))
        self._flush(pending, on_step)
        return kept, chosen
