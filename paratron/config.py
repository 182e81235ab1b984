"""Run configuration: dataclasses whose field names are Megatron-LM's flag names.

``--hidden-size 1024`` on the command line, ``hidden_size: 1024`` in YAML and ``cfg.model.hidden_size``
in Python are the same setting. Fields are grouped in sections (model, parallel, train, optim, data,
log, ckpt); every name is unique across sections, so a flat YAML file or command line maps onto
exactly one field. ``Config.flat()`` gives Megatron's flat ``args`` view.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the problem and the fix."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None  # default 4*hidden, or Megatron's 2/3 rule with --swiglu
    num_attention_heads: int = 4
    kv_channels: Optional[int] = None  # head dim; default hidden/heads
    group_query_attention: bool = False
    num_query_groups: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False  # Llama-3.1-style frequency scaling
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximate GeLU (GPT-2's "gelu_new")
    qk_layernorm: bool = False
    no_bias_swiglu_fusion: bool = False  # SwiGLU as torch ops instead of paratron's Triton kernel (CUDA)
    no_bias_dropout_fusion: bool = False  # add the residual after fc2 instead of as fc2's matmul operand
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False  # keep QKV bias even with --disable-bias-linear (Qwen2)
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128

    def fill_defaults(self) -> "ModelConfig":
        """Megatron's derived defaults (head dim, FFN size, query groups, max positions)."""
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            ffn = int((4 * self.hidden_size * 2 / 3) / 64) * 64 if self.swiglu else 0
            self.ffn_hidden_size = ffn or 4 * self.hidden_size
        if not self.group_query_attention or self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        return self


TransformerConfig = ModelConfig  # Megatron's name for the model-shape config


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False  # bf16 gradient buffer and reduction (needs --bf16)
    distributed_backend: Optional[str] = None  # nccl on GPU, gloo on CPU when not given
    distributed_timeout_minutes: int = 10


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default micro_batch_size * data-parallel size
    rampup_batch_size: Optional[list] = None
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # fixed fp16 loss scale; dynamic when not given
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    recompute_activations: bool = False
    recompute_granularity: Optional[str] = None  # full | selective
    recompute_method: Optional[str] = None  # uniform | block
    recompute_num_layers: Optional[int] = None
    device: Optional[str] = None  # paratron: cuda | cpu; default cuda when available
    torch_compile: bool = False  # paratron: torch.compile each transformer layer (regional compilation)
    no_fused_output_loss: bool = False  # paratron: plain logits + cross-entropy instead of the chunked fused path
    calculate_per_token_loss: bool = False  # loss = sum over the step's tokens / their count (else per micro-batch mean)


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: float = 0.0
    lr_decay_style: str = "linear"  # constant | linear | cosine | inverse-square-root | WSD
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"  # linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class DataConfig:
    data_path: Optional[list] = None
    split: str = "969,30,1"
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    num_workers: int = 2
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    null_tokenizer_eod_id: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class LogConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    log_throughput: bool = False
    log_params_norm: bool = False
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    plot_path: Optional[str] = None  # paratron: PNG loss plot; default <tensorboard-dir or save>/loss.png
    sample_prompt: Optional[str] = None  # paratron: print a generated sample from this prompt at the end


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    async_save: bool = False  # write in a background thread while training goes on
    ckpt_format: str = "torch_dist"  # torch.distributed.checkpoint, sharded (the only format)
    ckpt_step: Optional[int] = None  # load this iteration instead of the latest
    exit_on_missing_checkpoint: bool = False  # --load without a checkpoint is an error instead of a fresh start
    ckpt_keep_last: int = 0  # paratron: keep only the newest K checkpoints under --save (0: keep all)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "log": LogConfig,
    "ckpt": CheckpointConfig,
}

# Megatron flags that exist upstream but that paratron does not implement yet: naming them is a
# clear "not supported" error rather than "unknown flag".
UNSUPPORTED_MEGATRON_FLAGS = {
    "num_experts", "moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_grouped_gemm", "moe_token_dispatcher_type", "fp8_format", "fp8_hybrid", "fp8_amax_compute_algo",
    "fp8_amax_history_len", "tp_comm_overlap", "use_torch_fsdp2", "split_sentences",
    "transformer_impl", "use_flash_attn",
}

# Megatron flags that are accepted for compatibility and have no effect in paratron (the behaviour
# they select is the only one paratron has).
ACCEPTED_NO_OP_FLAGS = {"use_mcore_models", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
                        "no_gradient_accumulation_fusion", "use_dist_ckpt",
                        "ckpt_fully_parallel_save", "ckpt_fully_parallel_load", "ckpt_assume_constant_structure"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)

    def flat(self) -> argparse.Namespace:
        """Megatron's flat ``args`` view of every field (a copy)."""
        out = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return argparse.Namespace(**out)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, FIELD_SECTION[name]), name, value)

    def get(self, name: str) -> Any:
        return getattr(getattr(self, FIELD_SECTION[name]), name)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    # Derived values (never stored, so they cannot go stale).
    @property
    def padded_vocab_size(self) -> int:
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return int(math.ceil(self.data.vocab_size / multiple) * multiple)


FIELD_SECTION: dict[str, str] = {}
FIELD_TYPES: dict[str, Any] = {}
for _sec, _cls in SECTIONS.items():
    _hints = typing.get_type_hints(_cls)
    for _f in dataclasses.fields(_cls):
        assert _f.name not in FIELD_SECTION, f"duplicate config field {_f.name}"
        FIELD_SECTION[_f.name] = _sec
        FIELD_TYPES[_f.name] = _hints[_f.name]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _coerce(name: str, value: Any) -> Any:
    """Check and convert a YAML value to the field's type."""
    tp = _base_type(FIELD_TYPES[name])
    if value is None:
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if tp is list:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split()
        if tp is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if tp is float and isinstance(value, str):
            return float(value)  # YAML reads 1e-3 as a string
        if tp in (int, float) and isinstance(value, bool):
            raise TypeError
        return tp(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None


def suggest(name: str) -> str:
    known = list(FIELD_SECTION) + sorted(ACCEPTED_NO_OP_FLAGS)
    close = difflib.get_close_matches(name.replace("-", "_").lstrip("_"), known, n=1, cutoff=0.6)
    return f"; did you mean {flag(close[0])}?" if close else "; see `paratron train --help` for the flags"


def _check_known(name: str, source: str) -> None:
    if name in FIELD_SECTION or name in ACCEPTED_NO_OP_FLAGS:
        return
    if name in UNSUPPORTED_MEGATRON_FLAGS:
        raise ConfigError(f"{flag(name)} ({source}) is a Megatron-LM flag that paratron does not support yet")
    raise ConfigError(f"unknown flag {flag(name)} ({source}){suggest(name)}")


def apply_dict(cfg: Config, values: dict, source: str) -> None:
    """Apply a flat or sectioned mapping of Megatron-named settings (from YAML)."""
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            apply_dict(cfg, value, source)
            continue
        name = str(key).replace("-", "_")
        _check_known(name, source)
        if name in ACCEPTED_NO_OP_FLAGS and name not in FIELD_SECTION:
            continue
        cfg.set(name, _coerce(name, value))


PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file, or a preset by name (``--config tiny`` = configs/tiny.yaml)."""
    p = Path(path)
    if not p.is_file() and (PRESET_DIR / f"{path}.yaml").is_file():
        p = PRESET_DIR / f"{path}.yaml"
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass a YAML file or a preset ({', '.join(presets())})")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"config file {p} is not valid YAML{where}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must be a mapping of flag names to values")
    return data


def _bool_value(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise ConfigError(message)


def build_parser(prog: str = "paratron train") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                description="Train a GPT-style model. Flags are Megatron-LM's.")
    p.add_argument("--config", help="YAML file of settings (flat Megatron names or sections); flags override it")
    for sec, cls in SECTIONS.items():
        group = p.add_argument_group(sec)
        for f in dataclasses.fields(cls):
            tp = _base_type(FIELD_TYPES[f.name])
            if tp is bool:  # `--bf16` as Megatron's; `--bf16 false` turns off what a YAML file set
                group.add_argument(flag(f.name), dest=f.name, nargs="?", const=True, type=_bool_value,
                                   metavar="true|false")
            elif f.name == "rampup_batch_size":
                group.add_argument(flag(f.name), dest=f.name, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
            elif tp is list:
                group.add_argument(flag(f.name), dest=f.name, nargs="+")
            else:
                group.add_argument(flag(f.name), dest=f.name, type=tp)
    for name in sorted(ACCEPTED_NO_OP_FLAGS - set(FIELD_SECTION)):
        p.add_argument(flag(name), dest=f"_noop_{name}", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[list[str]] = None, base: Optional[Config] = None) -> Config:
    """Build a Config from YAML (``--config``) overridden by flags, then validate it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for tok in argv:  # catch unknown flags first, with a suggestion
        if tok.startswith("--") and tok != "--":
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            if name != "config" and not name.startswith("noop_"):
                _check_known(name, "command line")
    ns = build_parser().parse_args(argv)
    cfg = base if base is not None else Config()
    values = vars(ns)
    if "config" in values:
        path = values.pop("config")
        apply_dict(cfg, load_yaml(path), f"in {path}")
    if ({"data_path", "train_data_path"} & values.keys()) and "mock_data" not in values:
        cfg.data.mock_data = False  # real data on the command line replaces a preset's mock data
    for name, value in values.items():
        if name.startswith("_noop_"):
            continue
        if name == "rampup_batch_size":
            value = [int(v) for v in value]
        cfg.set(name, value)
    finalize(cfg)
    return cfg


def finalize(cfg: Config) -> Config:
    """Fill Megatron's derived defaults and validate; raises ConfigError with a one-line message."""
    m, par, tr, op, d = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.data

    def need(cond: bool, msg: str):
        if not cond:
            raise ConfigError(msg)

    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "log_interval", "eval_interval"):
        need(cfg.get(name) >= 1, f"{flag(name)} must be >= 1 (got {cfg.get(name)})")
    need(m.hidden_size % m.num_attention_heads == 0 or m.kv_channels is not None,
         f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
         "change one of them or set --kv-channels")
    need(not m.group_query_attention or m.num_query_groups is not None,
         "--group-query-attention needs --num-query-groups N")
    m.fill_defaults()
    need(m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0,
         f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups "
         f"{m.num_query_groups}")
    need(m.position_embedding_type in ("learned_absolute", "rope", "none"),
         f"--position-embedding-type must be learned_absolute, rope or none (got {m.position_embedding_type})")
    if m.position_embedding_type == "learned_absolute":
        need(m.seq_length <= m.max_position_embeddings,
             f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}; "
             "raise --max-position-embeddings")
    need(m.normalization in ("LayerNorm", "RMSNorm"),
         f"--normalization must be LayerNorm or RMSNorm (got {m.normalization})")
    need(0.0 < m.rotary_percent <= 1.0, "--rotary-percent must be in (0, 1]")
    need(0.0 <= m.hidden_dropout < 1 and 0.0 <= m.attention_dropout < 1, "dropout rates must be in [0, 1)")

    tp = par.tensor_model_parallel_size
    need(m.num_attention_heads % tp == 0,
         f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    need(m.num_query_groups % tp == 0,
         f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}; "
         "use more query groups or a smaller tensor-parallel size")
    need(m.ffn_hidden_size % tp == 0,
         f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if par.sequence_parallel and tp == 1:
        par.sequence_parallel = False  # Megatron does the same: SP needs TP > 1
    if par.sequence_parallel:
        need(m.seq_length % tp == 0,
             f"--sequence-parallel needs --seq-length {m.seq_length} divisible by --tensor-model-parallel-size {tp}")
    from .parallel.stages import finalize_pipeline  # imported here: parallel/ imports this module
    finalize_pipeline(par, m.num_layers)  # layers split over (virtual) pipeline stages

    need(not (tr.bf16 and tr.fp16), "--bf16 and --fp16 are mutually exclusive; choose one")
    need(tr.train_iters is None or tr.train_samples is None,
         "--train-iters and --train-samples are mutually exclusive; choose one")
    need(tr.train_iters is not None or tr.train_samples is not None,
         "set the length of training with --train-iters N or --train-samples N")
    need(op.lr is not None, "set the learning rate with --lr (e.g. --lr 3e-4)")
    need(op.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
         f"--lr-decay-style must be one of constant, linear, cosine, inverse-square-root, WSD "
         f"(got {op.lr_decay_style})")
    need(op.lr_wsd_decay_style in ("linear", "cosine", "exponential", "minus_sqrt"),
         "--lr-wsd-decay-style must be linear, cosine, exponential or minus_sqrt")
    c = cfg.ckpt
    need(c.ckpt_format in ("torch_dist", "torch_dcp"),
         f"--ckpt-format {c.ckpt_format} is not supported; paratron saves sharded torch.distributed.checkpoint "
         "checkpoints (--ckpt-format torch_dist)")
    need(c.ckpt_keep_last >= 0, f"--ckpt-keep-last must be >= 0 (got {c.ckpt_keep_last})")
    need(not c.async_save or c.save is not None, "--async-save needs --save DIR")
    need(op.optimizer == "adam", f"--optimizer {op.optimizer} is not supported; paratron has adam (AdamW)")
    if op.lr_warmup_fraction is not None:
        need(op.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        need(0.0 <= op.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must be in [0, 1]")
    need(op.min_lr <= op.lr, f"--min-lr {op.min_lr} is larger than --lr {op.lr}")
    if tr.recompute_activations:
        tr.recompute_granularity = "selective"
    need(tr.recompute_granularity in (None, "full", "selective"),
         "--recompute-granularity must be full or selective")
    if tr.recompute_granularity == "full":
        need(tr.recompute_method in ("uniform", "block"),
             "--recompute-granularity full needs --recompute-method uniform|block")
    need(tr.device in (None, "cuda", "cpu"), f"--device must be cuda or cpu (got {tr.device})")
    if tr.rampup_batch_size is not None:
        need(len(tr.rampup_batch_size) == 3, "--rampup-batch-size takes START INCREMENT SAMPLES")
        tr.rampup_batch_size = [int(v) for v in tr.rampup_batch_size]
        start, inc, samples = tr.rampup_batch_size
        need(tr.global_batch_size is not None, "--rampup-batch-size needs --global-batch-size (the final batch size)")
        need(start >= 1 and inc >= 1 and samples >= 0,
             f"--rampup-batch-size {start} {inc} {samples}: START and INCREMENT must be >= 1, SAMPLES >= 0")
        need(start <= tr.global_batch_size and (tr.global_batch_size - start) % inc == 0,
             f"--rampup-batch-size: --global-batch-size {tr.global_batch_size} minus START {start} must be a "
             f"non-negative multiple of INCREMENT {inc}")
    need(par.ddp_bucket_size is None or par.ddp_bucket_size >= 1, "--ddp-bucket-size must be >= 1 (elements)")
    need(not par.overlap_param_gather or par.use_distributed_optimizer,
         "--overlap-param-gather needs --use-distributed-optimizer")
    need(not par.grad_reduce_in_bf16 or tr.bf16, "--grad-reduce-in-bf16 needs --bf16")
    need(not (par.grad_reduce_in_bf16 and par.accumulate_allreduce_grads_in_fp32),
         "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are mutually exclusive; choose one")

    have_data = d.mock_data or d.data_path or d.train_data_path
    need(bool(have_data), "no training data: pass --data-path PREFIX (or --train-data-path) or --mock-data")
    need(not (d.mock_data and (d.data_path or d.train_data_path)),
         "--mock-data and --data-path are mutually exclusive; choose one")
    if d.tokenizer_type is None and d.mock_data:
        # No tokenizer flags with mock data: a NullTokenizer over the GPT-2 vocabulary size (its EOD,
        # vocab_size - 1 = 50256, is GPT-2's end-of-text id).
        d.tokenizer_type = "NullTokenizer"
        d.vocab_size = d.vocab_size or 50257
    need(d.tokenizer_type is not None, "set the tokenizer with --tokenizer-type (and its files); "
         "see docs/data.md")
    if d.tokenizer_type == "NullTokenizer":
        need(d.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size N")
    return cfg


def resolve_batch(cfg: Config, data_parallel_size: int) -> None:
    """Fill the global batch default and check it splits into micro-batches over data parallelism."""
    tr = cfg.train
    per_step = tr.micro_batch_size * data_parallel_size
    if tr.global_batch_size is None:
        tr.global_batch_size = per_step
    if tr.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {tr.global_batch_size} is not divisible by --micro-batch-size "
            f"{tr.micro_batch_size} x data-parallel size {data_parallel_size}; adjust one of them")
    if tr.rampup_batch_size is not None:
        start, inc, _ = tr.rampup_batch_size
        if start % per_step or inc % per_step:
            raise ConfigError(
                f"--rampup-batch-size START {start} and INCREMENT {inc} must be multiples of --micro-batch-size "
                f"{tr.micro_batch_size} x data-parallel size {data_parallel_size}")


def reference_markdown() -> str:
    """The config reference for docs/, generated from the dataclasses (see tools/gen_config_docs.py)."""
    lines = ["# Configuration reference", "",
             "Generated from `paratron/config.py` by `python tools/gen_config_docs.py`. Every field is a",
             "command-line flag (`--hidden-size`) and a YAML key (`hidden_size`), with Megatron-LM's name.",
             "A boolean flag alone sets it (`--bf16`); `--bf16 false` turns off what a YAML file or preset set.",
             ""]
    for sec, cls in SECTIONS.items():
        lines += [f"## {sec}", "", "| flag | type | default |", "|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = getattr(_base_type(hints[f.name]), "__name__", str(hints[f.name]))
            lines.append(f"| `{flag(f.name)}` | {tname} | `{default}` |")
        lines.append("")
    lines += ["## Megatron flags accepted with no effect", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(ACCEPTED_NO_OP_FLAGS)), "",
              "## Megatron flags not supported yet (a clear error)", "",
              ", ".join(f"`{flag(n)}`" for n in sorted(UNSUPPORTED_MEGATRON_FLAGS)), ""]
    return "\n".join(lines)
