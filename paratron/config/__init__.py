"""Run configuration: dataclasses whose field names are Megatron-LM's flag names (sections.py), built
from YAML and flags (parse.py), resolved once and frozen (validate.py).

    cfg = parse_args(["--config", "tiny", "--train-iters", "100"])   # parsed and resolved
    cfg.train.global_batch_size                                      # derived values are filled
    cfg.train.lr = 1.0                                               # FrozenConfigError
    other = cfg.unfrozen(); other.optim.lr = 1.0; resolve(other)     # a modified copy
"""
from ..errors import ConfigError, FrozenConfigError
from .docs import reference_markdown
from .parse import (ACCEPTED_NO_OP_FLAGS, PRESET_DIR, UNSUPPORTED_MEGATRON_FLAGS, add_tokenizer_args, apply_dict,
                    build_parser, load_yaml, parse_args, presets, suggest, tokenizer_config)
from .kernels import KernelConfig
from .sections import (FIELD_SECTION, FIELD_TYPES, SECTIONS, TOKENIZER_FIELDS, CheckpointConfig, Config, DataConfig,
                       LogConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, TransformerConfig, flag)
from .validate import (check_resolved, finalize, resolve, resolve_batch, resolve_model, validate_tokenizer,
                       world_size_default)

__all__ = [
    "ConfigError", "FrozenConfigError", "reference_markdown", "ACCEPTED_NO_OP_FLAGS", "PRESET_DIR",
    "UNSUPPORTED_MEGATRON_FLAGS", "add_tokenizer_args", "apply_dict", "build_parser", "load_yaml", "parse_args",
    "presets", "suggest", "tokenizer_config", "FIELD_SECTION", "FIELD_TYPES", "SECTIONS", "TOKENIZER_FIELDS",
    "CheckpointConfig", "Config", "KernelConfig", "DataConfig", "LogConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig",
    "TrainConfig", "TransformerConfig", "flag", "check_resolved", "finalize", "resolve", "resolve_batch",
    "resolve_model", "validate_tokenizer", "world_size_default",
]
