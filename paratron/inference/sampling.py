"""Sampling parameters, the next-token choice (greedy, temperature, top-k, top-p) and stop strings.

Every row of a batch has its own parameters, applied as tensors in one pass (a server batches
requests that asked for different things). A seeded row draws its noise from its own generator, so
its tokens do not depend on what else is in the batch; the prompts of one request (several ``--prompt``,
a list ``prompt``, ``n`` choices) share its seed but not its draws: prompt j seeds with (seed, j).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    """How to continue one prompt. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every
    token. Generation stops at ``max_new_tokens``, at the end-of-document token (unless
    ``ignore_eod``), or when the text contains one of ``stop`` (cut before it). ``logprobs``: return the
    log-probabilities (of the model's distribution at temperature 1) of the prompt and generated tokens."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple = field(default_factory=tuple)
    ignore_eod: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the n most likely tokens and their log-probabilities per step
    seed_offset: int = 0  # which prompt of its request this is: its generator starts from (seed, seed_offset)

    def row_seed(self) -> Optional[int]:
        """The seed of this prompt's generator: ``seed`` itself for the first prompt of a request, a
        different one (a fixed mix of seed and offset) for each further prompt."""
        if self.seed is None or self.seed_offset == 0:
            return self.seed
        return (int(self.seed) * 6364136223846793005 + self.seed_offset * 1442695040888963407) % (1 << 63)

    def check(self) -> Optional[str]:
        """The first invalid field as 'name: why', or None."""
        if self.max_new_tokens < 0:
            return f"max_new_tokens: must be >= 0 (got {self.max_new_tokens})"
        if self.temperature < 0:
            return f"temperature: must be >= 0 (got {self.temperature})"
        if self.top_k < 0:
            return f"top_k: must be >= 0 (got {self.top_k})"
        if self.top_logprobs < 0:
            return f"top_logprobs: must be >= 0 (got {self.top_logprobs})"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p: must be in (0, 1] (got {self.top_p})"
        return None


def on_device(values: list, device) -> torch.Tensor:
    """``values`` as a tensor on ``device``. To a GPU from pinned memory, without waiting: a plain copy of host
    memory makes torch wait for all the work queued on the device (under asynchronous paged steps, for the step
    still running), where a pinned one is queued behind it."""
    host = torch.tensor(values)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Sampler:
    """The per-row parameters of one batch as tensors, and the generators of its seeded rows."""

    def __init__(self, params: list[SamplingParams], device, generators: Optional[dict] = None):
        """``generators``: {row: generator} to draw from instead of seeding new ones (the paged engine's
        requests keep theirs from step to step: :func:`row_generator`)."""
        self.params = list(params)
        self.device = device
        self.temperature = on_device([max(p.temperature, 1e-6) for p in params], device)[:, None]
        self.is_greedy = on_device([p.temperature == 0 for p in params], device)
        self.top_k = on_device([p.top_k for p in params], device)[:, None]
        self.top_p = on_device([p.top_p for p in params], device)[:, None]
        self.generators = {}
        if generators is not None:
            self.generators = dict(generators)
            return
        for i, p in enumerate(params):
            self._seed(i, p)

    @property
    def greedy(self) -> bool:
        return all(p.temperature == 0 for p in self.params)

    @property
    def use_top_k(self) -> bool:
        return any(p.top_k > 0 for p in self.params)

    @property
    def use_top_p(self) -> bool:
        return any(p.top_p < 1.0 for p in self.params)

    def _seed(self, i: int, p: SamplingParams) -> None:
        """Row ``i``'s own generator when it samples with a seed."""
        self.generators.pop(i, None)
        g = row_generator(p, self.device)
        if g is not None:
            self.generators[i] = g

    def set_row(self, i: int, p: SamplingParams) -> None:
        """Row ``i`` takes ``p`` (a request joining a running batch; its seed starts a new generator)."""
        self.params[i] = p
        self.temperature[i, 0] = max(p.temperature, 1e-6)
        self.is_greedy[i] = p.temperature == 0
        self.top_k[i, 0], self.top_p[i, 0] = p.top_k, p.top_p
        self._seed(i, p)

    def _noise(self, shape) -> torch.Tensor:
        """Exponential(1) noise; seeded rows from their own generators."""
        q = torch.empty(shape, device=self.device).exponential_()
        for i, g in self.generators.items():
            q[i].exponential_(generator=g)
        return q

    def __call__(self, logits: torch.Tensor, best: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next token of each row from ``logits`` [b, vocab] (any float dtype); ``best``: their argmax where
        already computed (the compiled decode step's)."""
        best = logits.argmax(-1) if best is None else best
        if self.greedy:
            return best
        return torch.where(self.is_greedy, best, self.draw(self.probs(logits)))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each sampled row's distribution [b, vocab] (fp32) under its temperature, top-k and top-p (a greedy
        row's is meaningless: it takes the argmax)."""
        scaled = logits.float() / self.temperature
        if self.use_top_k or self.use_top_p:
            scaled = self._truncate(scaled)
        return torch.softmax(scaled, dim=-1)

    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One index per row drawn with probability proportional to ``weights`` [b, n] (>= 0, not necessarily
        normalised): an exponential race, seeded rows from their own generators."""
        return (weights / self._noise(weights.shape)).argmax(-1)

    def uniform(self, n: int) -> torch.Tensor:
        """[b, n] uniform draws in (0, 1], seeded rows from their own generators."""
        return torch.exp(-self._noise((len(self.params), n)))

    def _truncate(self, scaled: torch.Tensor) -> torch.Tensor:
        """Logits outside each row's top-k / top-p set -> -inf (the most likely token always stays)."""
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.size(-1), device=scaled.device)[None, :]
        keep = (rank < self.top_k) | (self.top_k == 0)
        if self.use_top_p:
            probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
            keep &= (probs.cumsum(-1) - probs) < self.top_p
        keep[:, 0] = True
        masked = ordered.masked_fill(~keep, float("-inf"))
        return torch.full_like(scaled, float("-inf")).scatter(-1, order, masked)


def row_generator(p: SamplingParams, device) -> Optional[torch.Generator]:
    """The generator a seeded, sampling row draws from (None: greedy or unseeded)."""
    if p.seed is not None and p.temperature > 0:
        return torch.Generator(device=device).manual_seed(p.row_seed())
    return None


def find_stop(text: str, stops) -> Optional[int]:
    """Index where the first of ``stops`` starts in ``text``, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
