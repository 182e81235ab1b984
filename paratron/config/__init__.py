"""Run configuration: dataclasses whose field names are Megatron-LM's flag names (sections.py), built
from YAML and flags (parse.py), resolved once and frozen (resolution.py,
with the checks of each section in check_<section>.py). This package reads no file but YAML: the run's
facts (a tokenizer's files, --use-checkpoint-args, the device) come from paratron.train.resolve.

    cfg = parse_args(["--config", "tiny", "--train-iters", "100"])   # parsed and resolved
    cfg.train.global_batch_size                                      # derived values are filled
    cfg.train.lr = 1.0                                               # FrozenConfigError
    other = cfg.unfrozen(); other.optim.lr = 1.0; resolve(other)     # a modified copy
"""
from ..errors import ConfigError, FrozenConfigError
from .docs import reference_markdown
from .parse import (ACCEPTED_NO_OP_FLAGS, PRESET_DIR, UNSUPPORTED_MEGATRON_FLAGS, add_tokenizer_args, apply_dict,
                    build_parser, load_yaml, parse_args, presets, resolve_alone, suggest, tokenizer_config)
from .kernels import KernelConfig
from .sections import (FIELD_SECTION, FIELD_TYPES, SECTIONS, TOKENIZER_FIELDS, CheckpointConfig, Config, DataConfig,
                       LogConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, TransformerConfig, flag)
from .check_data import validate_tokenizer
from .resolution import (check_resolved, declared_vocab_size, finalize, resolve, resolve_batch, resolve_model,
                         world_size_default)

__all__ = [
    "ConfigError", "FrozenConfigError", "reference_markdown", "ACCEPTED_NO_OP_FLAGS", "PRESET_DIR",
    "UNSUPPORTED_MEGATRON_FLAGS", "add_tokenizer_args", "apply_dict", "build_parser", "load_yaml", "parse_args",
    "presets", "resolve_alone", "suggest", "tokenizer_config",
    "FIELD_SECTION", "FIELD_TYPES", "SECTIONS", "TOKENIZER_FIELDS",
    "CheckpointConfig", "Config", "KernelConfig", "DataConfig", "LogConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig",
    "TrainConfig", "TransformerConfig", "flag", "check_resolved", "finalize", "resolve", "resolve_batch",
    "resolve_model", "validate_tokenizer", "world_size_default", "declared_vocab_size",
]
