"""A run's processes: the device and default process group from torchrun's environment, the
ParallelDims and the checkpoint group, all bounded by ``--distributed-timeout-minutes``; and the
one-line report of a collective that timed out.

Every process group paratron creates (the default one, each group of ParallelDims, the
checkpoint group) gets the timeout, as Megatron's do; the pipeline's point-to-point waits get it
too (paratron/parallel/p2p.py). On CPU (gloo) a collective whose peer does not answer raises in
the waiting rank after the timeout; :func:`timeout_report` turns that into one line naming the
collective, its group and the rank(s) that did not answer, and ``paratron train`` exits with it.
With NCCL, torch's watchdog ends the process after the same timeout with its own report.
"""
from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..errors import UserError
from ..parallel.dims import ParallelDims, initialize_model_parallel
from ..parallel.p2p import PipelineError


class DistributedTimeoutError(UserError):
    """A collective or pipeline transfer that a peer did not answer in time (a hung, stopped or dead
    rank); reported as one line like every UserError, though the fix is the peer's."""


def timeout(cfg: Config) -> timedelta:
    return timedelta(minutes=cfg.parallel.distributed_timeout_minutes)


def init_distributed(cfg: Config) -> torch.device:
    """Device and process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    given = cfg.parallel.local_rank  # --local-rank of torch.distributed.launch (which also sets LOCAL_RANK)
    env = os.environ.get("LOCAL_RANK")
    if given is not None and env is not None and int(env) != given:
        raise ConfigError(f"--local-rank {given} contradicts LOCAL_RANK={env} from the launcher; remove the flag")
    local = int(env) if env is not None else (given or 0)
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(cpu_threads(cfg))
    if use_cuda:
        torch.cuda.set_device(device)
        use_expandable_segments()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = cfg.parallel.distributed_backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend, timeout=timeout(cfg))
    return device


def cpu_threads(cfg: Config) -> int:
    """The intra-op threads of this process on CPU: ``--cpu-threads``, else the cores this process may use
    divided by the processes torchrun started on this machine (measured: issue 48's record in
    benchmarks/results/cpu_threads.md; torch's own default takes every core in every process)."""
    if cfg.train.cpu_threads is not None:
        return cfg.train.cpu_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_processes())


def local_processes() -> int:
    """The processes torchrun started on this machine (1 outside torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_memory_available() -> int:
    """Bytes of host memory the kernel counts as available (MemAvailable; physical pages where /proc is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def use_expandable_segments() -> None:
    """Let the CUDA caching allocator grow segments in place instead of keeping blocks of fixed
    sizes, which fragment when micro-batches are large (the user's PYTORCH_CUDA_ALLOC_CONF wins)."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if setter is not None:
        setter("expandable_segments:True")


def build_dims(cfg: Config) -> ParallelDims:
    p = cfg.parallel
    dims = initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                     p.virtual_pipeline_model_parallel_size, p.context_parallel_size,
                                     p.expert_model_parallel_size, p.expert_tensor_parallel_size,
                                     order="tp-cp-ep-pp-dp" if p.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
                                     timeout=timeout(cfg),
                                     hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes)
    dims.vpp_group = p.microbatch_group_size_per_virtual_pipeline_stage  # (Megatron: a ModelParallelConfig field)
    return dims


def checkpoint_group(cfg: Config):
    """The group of checkpoint collectives, their own so that a background save never interleaves with training's
    collectives: gloo (no GPU memory for the plans), or with --disable-gloo-process-groups the default backend's
    (NCCL on GPUs: a communicator more, no gloo group); None without torch.distributed."""
    if not (dist.is_initialized() and (cfg.ckpt.save or cfg.ckpt.load or cfg.ckpt.pretrained_checkpoint)):
        return None
    backend = None if cfg.parallel.disable_gloo_process_groups else "gloo"
    return dist.new_group(backend=backend, timeout=timeout(cfg), group_desc="checkpoint")


def _collective(e: BaseException) -> tuple[Optional[str], object]:
    """(name, process group) of the innermost torch.distributed call in ``e``'s traceback (name None:
    the error did not come from a collective)."""
    name, group, tb = None, None, e.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if "torch/distributed" in f.f_code.co_filename.replace(os.sep, "/") and (
                "group" in f.f_locals or "process_group" in f.f_locals):
            name = f.f_code.co_name
            group = f.f_locals.get("group", f.f_locals.get("process_group"))
        tb = tb.tb_next
    return name, group


def _members(group) -> tuple[list[int], str]:
    """The global ranks and the name (``group_desc``) of a process group (None: the default one)."""
    group = group if group is not None else dist.group.WORLD
    try:
        return dist.get_process_group_ranks(group), getattr(group, "group_desc", "") or "default"
    except (RuntimeError, ValueError):  # a group torch no longer knows: only the world is certain
        return list(range(dist.get_world_size())), "default"


def timeout_report(e: BaseException, minutes: float) -> Optional[str]:
    """One line for a collective or pipeline transfer that timed out or lost its peer (None: ``e`` is
    something else). It names this rank, the collective, its group and the other ranks of the group:
    one of them did not answer (in a group of two, that one)."""
    if isinstance(e, PipelineError) and ("timed out" in str(e) or "lost rank" in str(e)):
        return " ".join(str(e).split())
    if not isinstance(e, RuntimeError) or not dist.is_initialized():
        return None
    op, group = _collective(e)
    if op is None:
        return None
    text, me = str(e).lower(), dist.get_rank()
    ranks, label = _members(group)
    peers = [r for r in ranks if r != me]
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
    where = f"rank {me}: {op} on the {label} group (ranks {ranks})"
    if "timed out" in text or "timeout" in text:
        return (f"{where} timed out after {minutes:g} min (--distributed-timeout-minutes): {who} did not answer; "
                "is it stopped, hung (a file system, a deadlock) or dead? Its own log says more")
    if "connection" in text or "peer" in text or "broken pipe" in text:
        detail = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(e).split())).split(". ")[0][:160]
        return f"{where} failed: {who} exited or its connection broke ({detail}); its own log says why"
    return None
