"""Megatron's run watchers: ``--profile-ranks`` (which ranks ``--profile`` traces), ``--log-progress``
(a progress.txt of the job beside the checkpoints) and ``--check-weight-hash-across-dp-replicas-interval``
(every data-parallel replica holds the same weights: a silent divergence, from a bad GPU or a bug, stops
the run at once).

progress.txt lines are Megatron's: ``<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world>\\t<event>``, the
events ``Starting job`` and ``Saved checkpoint`` (with the iteration, this job's TFLOP/s per GPU, the
floating-point operations and tokens of the run so far). Megatron's cumulative throughput over earlier
jobs is not there (paratron does not keep their training time).

The weight check fingerprints each parameter on the device (its bytes as 32-bit words, summed with
position-dependent odd weights in wrapping 64-bit arithmetic: any changed bit changes it), gathers the
fingerprints over the group each parameter is replicated on (``dp_cp`` for dense weights, ``edp`` for
experts) and raises naming the first parameter that differs and the ranks.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.sharding import spec_of


def profiled(log, rank: int) -> bool:
    """Whether ``--profile`` traces global rank ``rank`` (``--profile-ranks``; default every rank)."""
    return log.profile_ranks is None or rank in log.profile_ranks


def record_memory_history(log, rank: int) -> bool:
    """``--record-memory-history`` (Megatron's) on the ranks ``--profile-ranks`` names: the CUDA caching
    allocator records every allocation and free (up to 100,000 events, with Python stacks) from here on,
    before the model is built, and an out-of-memory error dumps ``<base>_oom_rank_<rank><ext>`` of
    ``--memory-snapshot-path``. Returns whether it recorded (then :func:`dump_memory_snapshot` writes
    ``<base>_<rank><ext>``, for PyTorch's memory_viz)."""
    if not log.record_memory_history or not profiled(log, rank):
        return False
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=100_000)
    base, ext = os.path.splitext(log.memory_snapshot_path)

    def on_oom(_device, _alloc, _device_alloc, _device_free) -> None:
        torch.cuda.memory._dump_snapshot(f"{base}_oom_rank_{rank}{ext}")
        print(f" [OOM] rank {rank} saved memory snapshot to {base}_oom_rank_{rank}{ext}", flush=True)
    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    return True


def dump_memory_snapshot(log, rank: int) -> None:
    base, ext = os.path.splitext(log.memory_snapshot_path)
    torch.cuda.memory._dump_snapshot(f"{base}_{rank}{ext}")


class ProgressLog:
    """``--log-progress``: appends to ``<save>/progress.txt`` on global rank 0 (nothing elsewhere)."""

    def __init__(self, cfg, rank: int, world: int, flops_per_iteration: float, start_iteration: int):
        self.path: Optional[Path] = Path(cfg.ckpt.save) / "progress.txt" if cfg.log.log_progress and rank == 0 else None
        self.world, self.flops = world, flops_per_iteration
        self.start_time, self.start_iteration = time.time(), start_iteration
        self.seq = cfg.model.seq_length
        self.write("Starting job")

    def write(self, event: str) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                    f"# GPUs: {self.world}\t{event}\n")

    def saved(self, iteration: int, consumed_samples: int) -> None:
        seconds = max(time.time() - self.start_time, 1e-9)
        job = (iteration - self.start_iteration) * self.flops / seconds / self.world / 1e12
        self.write(f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.2f} TFLOP/s/GPU\t"
                   f"Floating-point operations: {iteration * self.flops:.2e}\t"
                   f"Tokens (in billions): {consumed_samples * self.seq / 1e9:.2f}")


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of ``p``'s bytes (0-d int64 on its device)."""
    raw = p.detach().contiguous().view(-1).view(torch.uint8)
    raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)]).view(torch.int32).to(torch.int64)
    odd = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) * 2654435762 + 1  # a distinct odd weight each
    return (raw * odd).sum()


def check_weight_hashes(models: list, dims, iteration: int) -> None:
    """Raise RuntimeError when a parameter differs between the replicas that should hold it equally."""
    by_group: dict = {}
    for m in models:
        m.finish_param_sync()  # the distributed optimizer's gathers still in flight
        for name, p in m.module.named_parameters():
            by_group.setdefault(spec_of(p).grad_group, []).append((name, p))
    for group_name, params in by_group.items():
        group = dims.group(group_name)
        size = dims.size(group_name)
        if size == 1 or group is None:
            continue
        mine = torch.stack([_fingerprint(p) for _, p in params])
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        for r, theirs in enumerate(every):
            differ = (theirs != mine).nonzero()
            if differ.numel():
                name = params[int(differ[0])][0]
                ranks = dims.group_ranks[group_name]
                raise RuntimeError(f"iteration {iteration}: parameter {name} differs between data-parallel replicas "
                                   f"(global ranks {dims.rank} and {ranks[r]}, group {group_name}); the replicas "
                                   "have diverged: check the GPUs of these ranks")


class StragglerWatch:
    """``--log-straggler`` (Megatron's straggler detector): each rank times its forward-backward (CUDA
    events on a GPU, no host synchronisation; the wall clock on a CPU) and, every log interval, the ranks
    gather their time per iteration and estimated TFLOP/s (the step's FLOPs over the ranks, over that
    time); global rank 0 prints Megatron's line, ``MnRtt/Rnk`` / ``MxRtt/Rnk`` (the shortest and longest
    time, ms, and its rank) and ``MnEtpt/Rnk`` / ``MxEtpt/Rnk`` (lowest and highest TFLOP/s), and, with
    ``--straggler-minmax-count N`` (1 < N < world), the N lowest and N highest ranks. Megatron's GPU
    power, temperature, utilisation and clock columns (NVML) are not there.

    The switch: a TCP connection to ``--straggler-ctrlr-port`` on global rank 0 (``curl host:port``) turns
    the detector off, or on (``--disable-straggler-on-startup`` starts it off); the change applies at
    the next log interval, when rank 0 broadcasts the state."""

    def __init__(self, log, device: torch.device, rank: int, world: int):
        self.enabled = bool(log.log_straggler)
        self.on = self.enabled and not log.disable_straggler_on_startup
        self.count, self.device, self.rank, self.world = log.straggler_minmax_count, device, rank, world
        self._events: list = []
        self._seconds = 0.0
        self._toggle = False
        self._sock = None
        if self.enabled and rank == 0:
            self._serve(log.straggler_ctrlr_port)

    def _serve(self, port: int) -> None:
        import socket
        import threading
        try:
            self._sock = socket.create_server(("", port))
        except OSError as err:
            print(f" WARNING: --log-straggler: cannot listen on --straggler-ctrlr-port {port} ({err}); the detector "
                  "runs without its on/off switch", flush=True)
            return

        def answer() -> None:
            while True:
                try:
                    conn, _ = self._sock.accept()
                except OSError:  # closed
                    return
                with conn:
                    conn.recv(1024)
                    self._toggle = True
                    msg = f"Will turn StragglerDetector {'OFF' if self.on else 'ON'} at next logging interval"
                    conn.sendall(f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}\r\n\r\n{msg}"
                                 .encode())
        threading.Thread(target=answer, name="straggler-switch", daemon=True).start()

    @contextmanager
    def timed(self):
        """Around the step's forward-backward."""
        if not self.on:
            yield
            return
        if self.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            stop.record()
            self._events.append((start, stop))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def _take(self) -> float:
        seconds = self._seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        self._events, self._seconds = [], 0.0
        return seconds

    def report(self, iterations: int, flops_per_iteration: float) -> list:
        """Every rank calls it each log interval; the lines global rank 0 prints (none elsewhere)."""
        if not self.enabled:
            return []
        lines = []
        if self.on and iterations:
            if self._events:
                self._events[-1][1].synchronize()
            per_iter = max(self._take() / iterations, 1e-9)
            mine = torch.tensor([per_iter, flops_per_iteration / self.world / per_iter / 1e12], dtype=torch.float64,
                                device=self.device)
            every = [mine]
            if dist.is_initialized():
                every = [torch.empty_like(mine) for _ in range(self.world)]
                dist.all_gather(every, mine)
            if self.rank == 0:
                lines = self._lines([tuple(v.tolist()) for v in every])
        self._switch()
        return lines

    def _lines(self, values: list) -> list:
        ms = sorted((v[0] * 1000.0, r) for r, v in enumerate(values))
        tf = sorted((v[1], r) for r, v in enumerate(values))
        out = [f"[{datetime.now():%Y-%m-%d %H:%M:%S}] | MnRtt/Rnk: {ms[0][0]:.2f}ms/{ms[0][1]} | MxRtt/Rnk: "
               f"{ms[-1][0]:.2f}ms/{ms[-1][1]} | MnEtpt/Rnk: {tf[0][0]:.2f}TF/{tf[0][1]} | MxEtpt/Rnk: "
               f"{tf[-1][0]:.2f}TF/{tf[-1][1]}"]
        if 1 < self.count < self.world:
            out.append(f"^^^^ Bottom {self.count} Ranks with lowest  Etpt(TF): "
                       + ", ".join(f"{v:.2f}/{r}" for v, r in tf[:self.count]))
            out.append(f"^^^^ Top    {self.count} Ranks with highest Etpt(TF): "
                       + ", ".join(f"{v:.2f}/{r}" for v, r in tf[-self.count:]))
        return out

    def _switch(self) -> None:
        """Apply a switch request rank 0 received: its new state, broadcast to every rank."""
        flip, self._toggle = self._toggle, False  # only rank 0's switch thread sets it
        state = torch.tensor([self.on != flip], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.broadcast(state, 0)
        on = bool(state.item())
        if on != self.on:
            self._events, self._seconds = [], 0.0  # a fresh window
            if self.rank == 0:
                print(f" Toggling StragglerDetector State {'ON' if on else 'OFF'}", flush=True)
        self.on = on

    def close(self) -> None:
        if self._sock is not None:
            import socket
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
            except OSError:
                pass
            self._sock.close()
            self._sock = None
