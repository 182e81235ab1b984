"""The serving engine's fields: ``paratron serve`` flags (Megatron's inference flag names where Megatron has
one, paratron's own otherwise), printed when the server starts. Not training flags: ``paratron train`` refuses
them by name (config/megatron_flags.py).

``--inference-dynamic-batching`` chooses the paged engine (paratron/inference/paged.py: a block allocator over
one KV pool, continuous batching with a token budget per step, prefix caching, CUDA-graphed decode); without it
the server runs the fixed-batch engine (engine.py), optionally with ``--continuous-batching``.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .section_base import Section

EVICTION_POLICIES = ("ref_zero", "lru")
ASYNC_SCHED_MODES = ("legacy", "async")


@dataclass(eq=True)
class InferenceConfig(Section):
    _name = "inference"
    inference_dynamic_batching: bool = False  # serve with the paged engine (blocks, chunked prefill, prefix cache)
    inference_dynamic_batching_block_size: int = 256  # tokens per KV-cache block
    inference_dynamic_batching_buffer_size_gb: Optional[float] = None  # KV pool size in GB (None: see below)
    inference_dynamic_batching_num_blocks: Optional[int] = None  # paratron: the KV pool in blocks (overrides GB)
    inference_dynamic_batching_memory_fraction: float = 0.9  # paratron: of free GPU memory for the pool (no size)
    inference_dynamic_batching_max_requests: int = 256  # requests running at once (decode rows of a step)
    inference_dynamic_batching_max_tokens: int = 16384  # tokens per step: decodes plus prompt tokens (prefill)
    enable_chunked_prefill: bool = False  # split prompts over steps to fit the token budget beside decodes
    inference_dynamic_batching_prefix_caching: bool = False  # share full blocks of identical prompt prefixes
    inference_dynamic_batching_prefix_caching_eviction_policy: str = "ref_zero"  # ref_zero | lru
    inference_dynamic_batching_num_cuda_graphs: int = 16  # decode-step CUDA graphs (batch buckets; 0: none)
    inference_dynamic_batching_cuda_graph_mixed_prefill_count: int = 16  # graphs of steps with <= N prompting requests
    inference_dynamic_batching_cuda_graph_max_tokens: int = 16384  # the most tokens a captured mixed step holds
    inference_dynamic_batching_async_sched_mode: str = "legacy"  # legacy | async: schedule step n+1 while n runs
    serve_max_queued_requests: int = 1024  # paratron: requests waiting or running; more are a 429 (0: no limit)
    serve_max_queued_tokens: int = 0  # paratron: prompt + max new tokens waiting or running; 429 (0: no limit)


FIELDS = tuple(f.name for f in dataclasses.fields(InferenceConfig))


def check_inference(c: InferenceConfig) -> None:
    """One line naming the first bad field."""
    positive = ("inference_dynamic_batching_block_size", "inference_dynamic_batching_max_requests",
                "inference_dynamic_batching_max_tokens")
    for name in positive:
        if getattr(c, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(c, name)}: must be >= 1")
    if c.inference_dynamic_batching_cuda_graph_max_tokens < 2:
        raise ConfigError(f"--inference-dynamic-batching-cuda-graph-max-tokens "
                          f"{c.inference_dynamic_batching_cuda_graph_max_tokens}: must be >= 2")
    for name in ("inference_dynamic_batching_num_cuda_graphs", "serve_max_queued_requests", "serve_max_queued_tokens",
                 "inference_dynamic_batching_cuda_graph_mixed_prefill_count"):
        if getattr(c, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(c, name)}: must be >= 0")
    if c.inference_dynamic_batching_num_blocks is not None and c.inference_dynamic_batching_num_blocks < 2:
        raise ConfigError(f"--inference-dynamic-batching-num-blocks {c.inference_dynamic_batching_num_blocks}: "
                          "must be >= 2 (one block is the padding rows' scratch)")
    gb = c.inference_dynamic_batching_buffer_size_gb
    if gb is not None and gb <= 0:
        raise ConfigError(f"--inference-dynamic-batching-buffer-size-gb {gb}: must be > 0")
    if not 0 < c.inference_dynamic_batching_memory_fraction <= 1:
        raise ConfigError(f"--inference-dynamic-batching-memory-fraction "
                          f"{c.inference_dynamic_batching_memory_fraction}: must be in (0, 1]")
    policy = c.inference_dynamic_batching_prefix_caching_eviction_policy
    if policy not in EVICTION_POLICIES:
        raise ConfigError(f"--inference-dynamic-batching-prefix-caching-eviction-policy {policy}: choose one of "
                          f"{', '.join(EVICTION_POLICIES)}")
    mode = c.inference_dynamic_batching_async_sched_mode
    if mode not in ASYNC_SCHED_MODES:
        raise ConfigError(f"--inference-dynamic-batching-async-sched-mode {mode}: choose one of "
                          f"{', '.join(ASYNC_SCHED_MODES)}")


def field_help() -> dict[str, str]:
    """Each field's comment in the class above: its one-line help."""
    out = {}
    for line in inspect.getsource(InferenceConfig).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=[^#]+#\s*(.+)", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def add_arguments(parser, serve: bool = True) -> None:
    """The fields as ``paratron serve`` flags (booleans are switches; ``--no-...`` for prefix caching, as
    Megatron has); ``serve=False``: the engine's fields alone (``paratron generate``: no request queue)."""
    defaults, helps = InferenceConfig(), field_help()
    for f in dataclasses.fields(InferenceConfig):
        if not serve and f.name.startswith("serve_"):
            continue
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", default=default, help=helps[f.name])
            continue
        kind = {"inference_dynamic_batching_buffer_size_gb": float,
                "inference_dynamic_batching_memory_fraction": float,
                "inference_dynamic_batching_prefix_caching_eviction_policy": str,
                "inference_dynamic_batching_async_sched_mode": str}.get(f.name, int)
        parser.add_argument(flag, dest=f.name, type=kind, default=default, metavar="V",
                            help=helps[f.name].replace("%", "%%") + f" (default {default})")
    parser.add_argument("--no-inference-dynamic-batching-prefix-caching",
                        dest="inference_dynamic_batching_prefix_caching", action="store_false",
                        help="no prefix caching (the default)")


def from_args(args) -> InferenceConfig:
    """The section from parsed ``paratron serve`` (or ``generate``) arguments, checked."""
    out = InferenceConfig(**{name: getattr(args, name) for name in FIELDS if hasattr(args, name)})
    check_inference(out)
    return out


def startup_lines(c: InferenceConfig) -> list[str]:
    """Every field as it runs (the server prints them when it starts)."""
    engine = "paged (inference/paged.py)" if c.inference_dynamic_batching else "fixed-batch (inference/engine.py)"
    lines = [f" engine: {engine}; serve flags (config/inference.py):"]
    for name in FIELDS:
        lines.append(f"   --{name.replace('_', '-')} {getattr(c, name)}")
    return lines
