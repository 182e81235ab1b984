"""Processes for generation: one, or a tensor-parallel group under torchrun where rank 0 leads.

Every rank of ``torchrun --nproc-per-node N paratron generate|serve ...`` holds a TP shard of the model
(TP = N). Rank 0 reads the prompts (or serves HTTP); before each batch it broadcasts the requests to
the other ranks over a gloo group (CPU objects; its long timeout lets a server sit idle), then all
ranks run the same ``Engine.generate``; with the paged engine (``paged``), rank 0 sends each step's new
requests and all ranks step together. The others loop in :func:`follow` until rank 0 says stop.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..parallel.dims import ParallelDims, initialize_model_parallel
from .engine import Engine, Request

IDLE_TIMEOUT = timedelta(days=30)  # followers wait this long for the next request


def start(device: Optional[str] = None, ep: int = 1) -> tuple[ParallelDims, torch.device]:
    """Process group from torchrun's environment (NCCL on GPUs, gloo on CPU) and TP over all ranks; ``ep``
    (--expert-model-parallel-size): a mixture of experts' experts split over that many of them too (each rank
    holds num_experts / ep whole experts; tokens reach them by all-to-all)."""
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ep < 1 or world % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep}: must divide the {world} process(es) of the launch")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if want.startswith("cuda") else torch.device(want)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=IDLE_TIMEOUT)
    return initialize_model_parallel(world, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1 if ep > 1 else None), dev


class Group:
    """Rank 0's side: ``generate`` runs a batch on every rank; ``close`` releases the followers."""

    def __init__(self, engine: Engine, dims: ParallelDims):
        self.engine, self.dims = engine, dims
        self.control = None
        if dims.world_size > 1:
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @property
    def leader(self) -> bool:
        return self.dims.rank == 0

    def send(self, message) -> None:
        """Rank 0: ``message`` (kind, payload) to the followers (nothing on one process)."""
        if self.control is not None:
            dist.broadcast_object_list([message], src=0, group=self.control)

    def paged(self, cfg):
        """Rank 0: the paged engine (``cfg``: the InferenceConfig), built on every rank of the group."""
        from .paged_spec import build_paged
        self.send(("paged", cfg))
        return build_paged(self.engine, cfg, self)

    def generate(self, requests: list[Request], on_step: Optional[Callable] = None):
        for r in requests:  # refused here, before the followers see it
            problem = self.engine.check(r)
            if problem:
                raise ValueError(problem)
        self.send(("generate", requests))
        return self.engine.generate(requests, on_step)

    def follow(self):
        """Ranks > 0: run every batch rank 0 sends until it sends stop; with the paged engine, every step with
        the requests rank 0 added before it. Returns the last paged engine built (None: none), its pool as the
        steps left it."""
        paged = None
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            kind, payload = box[0]
            if kind == "stop":
                return paged
            if kind == "generate":
                self.engine.generate(payload)
            elif kind == "paged":
                from .paged_spec import build_paged
                try:
                    paged = build_paged(self.engine, payload, self)
                except ConfigError:  # rank 0 stops with the same line and sends stop
                    paged = None
            elif kind == "step":
                for request in payload:
                    paged.add(request)
                try:
                    paged.step()
                except Exception:  # noqa: BLE001 - as rank 0's step fails too; its "abort" follows
                    paged.abort()
            elif kind == "abort":
                paged.abort()

    def close(self) -> None:
        if not self.leader:
            return
        try:
            self.send(("stop", None))
        except RuntimeError:  # the followers are gone already (Ctrl-C reaches every rank under torchrun)
            pass
