"""``--use-checkpoint-args``: the model's shape and tokenizer come from the config stored in the
``--load`` checkpoint (its ``common.json``), as Megatron overrides its model arguments from the
checkpoint's. Flags given on the command line for those fields are replaced; parallel sizes, the
schedule and the data stay the run's own (paratron reshards any layout)."""
from __future__ import annotations

from ..errors import ConfigError
from .sections import FIELD_SECTION, TOKENIZER_FIELDS, Config

# The data-section fields taken with the model: the tokenizer (its vocabulary sizes the embedding).
CHECKPOINT_DATA_FIELDS = tuple(n for n in TOKENIZER_FIELDS if n != "vocab_size")


def apply_checkpoint_args(cfg: Config) -> None:
    """Overwrite ``cfg``'s model fields and tokenizer flags with the ones of the latest checkpoint
    under --load (before resolve). No checkpoint: an error with --exit-on-missing-checkpoint, else
    the flags stay (a fresh start, as Megatron)."""
    c = cfg.ckpt
    if not c.use_checkpoint_args or not c.load:
        return
    from ..checkpoint import sharded
    done = sharded.complete_iterations(c.load)  # the files are verified when the run loads them
    it = c.ckpt_step if c.ckpt_step is not None else (max(done) if done else None)
    d = sharded.iter_dir(c.load, it) if it is not None else None
    if d is None or not (d / sharded.COMMON).is_file():
        if c.exit_on_missing_checkpoint:
            raise ConfigError(f"--use-checkpoint-args: no checkpoint in {c.load} (--exit-on-missing-checkpoint)")
        return
    saved = sharded.read_common(d).get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise ConfigError(f"--use-checkpoint-args: {d} holds no paratron config; give the model flags instead")
    for name, value in saved["model"].items():
        if FIELD_SECTION.get(name) == "model":
            cfg.set(name, value)
    for name in CHECKPOINT_DATA_FIELDS:
        if name in saved.get("data", {}):
            cfg.set(name, saved["data"][name])
