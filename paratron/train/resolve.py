"""The run's resolve: :func:`paratron.config.resolve` with the facts the config package does not read (it
imports nothing above paratron.errors): the vocabulary size from the tokenizer's files, the model of the
``--load`` checkpoint for ``--use-checkpoint-args``, and whether the device runs FP8. ``paratron train``,
pretrain_gpt.py and the Trainer resolve with it:

    cfg = parse_args(argv)          # paratron.config.parse_args, with the run's resolve
    cfg = resolve(cfg, world_size)  # an unresolved Config; a resolved one is checked and returned as it is

``--use-checkpoint-args``: the model's shape and tokenizer come from the config stored in the ``--load``
checkpoint (its ``common.json``), as Megatron overrides its model arguments from the checkpoint's. Flags
given on the command line for those fields are replaced; parallel sizes, the schedule and the data stay
the run's own (paratron reshards any layout).
"""
from __future__ import annotations

from typing import Optional

from .. import config
from ..config import FIELD_SECTION, TOKENIZER_FIELDS, Config, ConfigError
from ..data.tokenizers import tokenizer_vocab_size

# The data-section fields taken with the model: the tokenizer (its vocabulary sizes the embedding).
CHECKPOINT_DATA_FIELDS = tuple(n for n in TOKENIZER_FIELDS if n != "vocab_size")


def apply_checkpoint_args(cfg: Config) -> None:
    """Overwrite ``cfg``'s model fields and tokenizer flags with the ones of the checkpoint the run will load (before
    resolve): the latest under --load, else under --pretrained-checkpoint. No checkpoint: an error with
    --exit-on-missing-checkpoint, else the flags stay (a fresh start, as Megatron)."""
    c = cfg.ckpt
    if not c.use_checkpoint_args or not (c.load or c.pretrained_checkpoint):
        return
    from ..checkpoint import sharded  # (here: torch.distributed.checkpoint costs a second at start-up)

    def latest(root):
        done = sharded.complete_iterations(root) if root else []  # the files are verified when the run loads them
        it = c.ckpt_step if c.ckpt_step is not None else (max(done) if done else None)
        d = sharded.iter_dir(root, it) if it is not None else None
        return d if d is not None and (d / sharded.COMMON).is_file() else None

    d = latest(c.load) or latest(c.pretrained_checkpoint)
    if d is None and _megatron_args(cfg):
        return
    if d is None:
        if c.exit_on_missing_checkpoint:
            where = " or ".join(r for r in (c.load, c.pretrained_checkpoint) if r)
            raise ConfigError(f"--use-checkpoint-args: no checkpoint in {where} (--exit-on-missing-checkpoint)")
        return
    saved = sharded.read_common(d).get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise ConfigError(f"--use-checkpoint-args: {d} holds no paratron config; give the model flags instead")
    _take(cfg, saved["model"], saved.get("data", {}))


def _take(cfg: Config, model: dict, data: dict) -> None:
    """A checkpoint's model fields and the tokenizer flags it holds into ``cfg``."""
    for name, value in model.items():
        if FIELD_SECTION.get(name) == "model":
            cfg.set(name, value)
    for name in CHECKPOINT_DATA_FIELDS:
        if name in data:
            cfg.set(name, data[name])


def _megatron_args(cfg: Config) -> bool:
    """--use-checkpoint-args with Megatron-LM's own checkpoint under --load / --pretrained-checkpoint: the model and
    tokenizer flags from the ``args`` it saved (checkpoint/megatron.py reads them under paratron's names)."""
    from ..checkpoint import megatron
    from pathlib import Path
    c = cfg.ckpt
    root = next((r for r in (c.load, c.pretrained_checkpoint) if r and megatron.locate(Path(r), c.ckpt_step)), None)
    if root is None:
        return False
    model, args = megatron.saved_model_args(Path(root), c.ckpt_step)
    _take(cfg, model, {k: v for k, v in args.items() if v is not None})  # (Megatron's args hold every flag: unset None)
    return True


def check_device(cfg: Config) -> None:
    """FP8 matmuls need a GPU that has them (--fp8-format); --log-energy a GPU and NVML's bindings; CUDA graphs a
    GPU."""
    if cfg.log.log_energy:
        import torch
        from .energy import NVML_MISSING, nvml
        if cfg.train.device == "cpu" or not torch.cuda.is_available():
            raise ConfigError("--log-energy reads a GPU's energy counter; this run is on the CPU: remove the flag")
        if nvml() is None:
            raise ConfigError(NVML_MISSING)
    if cfg.train.cuda_graph_impl == "local":
        import torch
        if cfg.train.device == "cpu" or not torch.cuda.is_available():
            raise ConfigError("--cuda-graph-impl local: CUDA graphs need a GPU and none is visible here; remove the "
                              "flag (and --cuda-graph-scope) for a CPU run")
    if cfg.train.fp8_format is not None:
        from .. import fp8  # (here: a flag mistake is reported before torch is imported)
        problem = fp8.device_problem("cpu" if cfg.train.device == "cpu" else "cuda")
        if problem is not None:
            raise ConfigError(problem)


def resolve(cfg: Config, world_size: Optional[int] = None) -> Config:
    """``cfg`` resolved for ``world_size`` processes (see :func:`paratron.config.resolve`), its vocabulary
    size read from the tokenizer's files and the device checked. A resolved config (one that
    paratron.config resolved alone too) is checked for the device and returned as it is."""
    if cfg.is_resolved:
        config.resolve(cfg, world_size)  # the world-size check
        check_device(cfg)
        return cfg
    return config.resolve(cfg, world_size, vocab_size=tokenizer_vocab_size, checks=(check_device,))


def resolve_with_checkpoint_args(cfg: Config, world_size: Optional[int] = None) -> Config:
    """:func:`resolve` after ``--use-checkpoint-args`` took the checkpoint's model (what parse_args does)."""
    apply_checkpoint_args(cfg)
    return resolve(cfg, world_size)


def parse_args(argv: Optional[list[str]] = None, base: Optional[Config] = None,
               world_size: Optional[int] = None) -> Config:
    """:func:`paratron.config.parse_args` with the run's resolve: flags and YAML, ``--use-checkpoint-args``,
    the tokenizer's vocabulary and the device (every problem of the command line reported at once)."""
    return config.parse_args(argv, base, world_size, resolve=resolve_with_checkpoint_args)
