"""Seeding, the RNG fork for tensor-parallel regions, and activation checkpointing that replays it.

Outside tensor-parallel regions (replicated activations) every TP rank must draw the same dropout
mask, so the default generator is seeded identically across TP ranks. Inside them (attention
probabilities of this rank's heads, sequence-sharded activations) the masks must differ, so the
model draws from a second generator state, seeded per TP rank, swapped in by ``fork()``. The
tracker is an object owned by the model, not module state. :func:`checkpoint` recomputes a function
in backward with the same masks from both streams.
"""
from __future__ import annotations

import contextlib
import hashlib
import random

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

TP_SEED_OFFSET = 2718
EXPERT_SEED_OFFSET = 1024  # Megatron's expert-parallel stream: seed + 1024 + 100 x EP rank + expert-TP rank


def set_seed(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy and torch; pipeline stages get distinct streams as in Megatron."""
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_seed(seed: int, name: str) -> int:
    """The seed of the initial weights of one named piece of the model ("embedding", "layer7", ...)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def seeded_init(seed: int, name: str, device=None):
    """Draw the weights initialised inside from their own stream ``init_seed(seed, name)``, leaving the
    global generators as they were. Each piece of the model (the embedding, each layer by its global
    index, the output layer) has its own stream, so a pipeline stage builds exactly its layers of the
    one-stage model without drawing, or even allocating, the others."""
    device = torch.device(device if device is not None else "cpu")
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        s = init_seed(seed, name)
        torch.random.default_generator.manual_seed(s)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(s)
        yield


class RNGTracker:
    """Holds the generator state of the tensor-parallel region for one device."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu", offset: int = TP_SEED_OFFSET):
        """Seeded ``seed + offset + tp_rank`` (``tp_rank``: this rank's index in the stream's group)."""
        self.device = torch.device(device)
        self.state = self._fresh_state(seed + offset + tp_rank)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = self._get()
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        state = self._get()
        self._set(saved)
        return state

    @contextlib.contextmanager
    def fork(self):
        saved = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(saved)

    def state_dict(self) -> dict:
        return {"state": self.state.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["state"].clone()


class _Replay:
    """checkpoint's recompute context for the trackers: the recomputation draws from the streams as
    the forward found them; on exit the live streams are back as they were before the recomputation."""

    def __init__(self, rngs: tuple, starts: list):
        self.rngs, self.starts = rngs, starts

    def __enter__(self):
        self.live = [r.state for r in self.rngs]
        for r, start in zip(self.rngs, self.starts):
            r.state = start.clone()

    def __exit__(self, *exc):
        for r, live in zip(self.rngs, self.live):
            r.state = live


def checkpoint(fn, *args, rng=None):
    """``fn(*args)`` under torch.utils.checkpoint (non-reentrant): its activations are recomputed in
    backward, with the same dropout masks. checkpoint replays the default generator itself; ``rng``,
    the tracker of the TP regions (or a tuple of trackers: also the expert-parallel one), is
    replayed by the recompute context it takes from ``context_fn``. That context is exited however the recomputation ends, and non-reentrant checkpoint ends it early
    (by raising out of ``fn``) once every tensor backward needs is recomputed: code after the call
    to ``fn`` would not run, and the stream would be left part-way through the recomputed draws."""
    rngs = tuple(r for r in (rng if isinstance(rng, tuple) else (rng,)) if r is not None)
    if not rngs:
        return torch_checkpoint(fn, *args, use_reentrant=False)
    return _checkpoint_replaying(fn, args, rngs)


# Inside a compiled region checkpoint takes no context_fn other than a selective-checkpoint policy,
# so this one runs eagerly: what it wraps is the attention core (one SDPA call) or whole layers, which
# are compiled on their own.
@torch.compiler.disable
def _checkpoint_replaying(fn, args, rngs: tuple):
    starts = [r.state.clone() for r in rngs]
    return torch_checkpoint(fn, *args, use_reentrant=False,
                            context_fn=lambda: (contextlib.nullcontext(), _Replay(rngs, starts)))


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Every RNG state of this process as 1-D tensors (checkpoints store them as rows of a
    [ranks, n] tensor; nothing is pickled)."""
    py_version, py_keys, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "python": torch.tensor([py_version, *py_keys], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss is not None, py_gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*np_keys.tolist(), int(np_pos), int(np_has_gauss)], dtype=torch.int64),
        "numpy_gauss": torch.tensor([float(np_gauss)], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    py = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has_gauss else None))
    n = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(n[:-2], dtype=np.uint32), n[-2], n[-1],
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
