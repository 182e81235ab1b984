"""One candidate layout of a run, everything the memory and time models read: the parallel sizes, the
data-parallel sharding strategy (ZeRO-1/2/3), recomputation, optimizer offload, micro-batch, precision.
:func:`layout_of` reads it from a resolved config; the search builds them directly."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import FIELD_SECTION, Config
from ..config.values import MOMENT_BYTES, bucket_end_multiple
from .paths import Paths, paths_of
from .traffic import Traffic

# Megatron's --data-parallel-sharding-strategy values: what data parallelism shards besides nothing.
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    sharding: str = "no_shard"  # STRATEGIES
    recompute: Optional[str] = None  # None | selective | full
    recompute_method: str = "uniform"  # full: uniform | block
    recompute_num_layers: Optional[int] = None  # full: --recompute-num-layers (None: 1, as the model)
    recompute_modules: tuple = ("core_attn",)  # selective: --recompute-modules (resolved)
    micro_batch: int = 1
    global_batch: int = 1
    seq_length: int = 2048
    param_bytes: int = 2  # the model's weights: 2 (bf16/fp16) or 4 (fp32)
    grad_bytes: int = 4  # the gradient buffers: fp32 unless --grad-reduce-in-bf16 (or fp16 without fp32 grads)
    fp8: bool = False
    fp8_param_gather: bool = False
    fp8_weight_cache: bool = True  # FP8 weights cast once per step of several micro-batches (fp8/weights.py)
    fp8_rules: tuple = ()  # --te-precision-config-file's matchers (config/precision_file.py): modules kept in bf16
    bf16_layers: frozenset = frozenset()  # decoder layers --first-last-layers-bf16 keeps out of FP8 (global indices)
    offload_fraction: float = 0.0  # share of fp32 masters and Adam moments kept on the host
    moment_bytes: int = 8  # Adam's two moments per element: 8 in fp32 (--exp-avg-dtype, --exp-avg-sq-dtype)
    scaled_moments: int = 0  # of them held in fp16 / fp8 (an fp32 scale per tensor each)
    offload_modules: tuple = ()  # --fine-grained-activation-offloading's points (--offload-modules)
    activation_offload_fraction: float = 1.0
    min_offloaded_tensor_size: int = 1048576
    bucket_size: Optional[int] = None  # --ddp-bucket-size: elements per gradient bucket
    num_buckets: Optional[int] = None  # --ddp-num-buckets: the rank's parameters / N per bucket instead
    bucket_end_multiple: int = 1  # every bucket's size a multiple of it too (2^16: --ddp-pad-buckets-for-...)
    overlap_grad_reduce: bool = False  # without a bucket size: Megatron's default buckets (else one per buffer)
    overlap_param_gather: bool = False
    paths: Paths = Paths()  # the layers' code paths on the planned GPU (paths.py); default: the torch paths
    host_ops: tuple = (0, 0)  # eager aten operations of (one layer, the rest) fwd + bwd (host.py; GPU plans only)
    compiled: bool = False  # --torch-compile: the layers' non-matmul operations fused (traffic.py)
    step_graph: bool = False  # --cuda-graph-impl local: the step replayed as one CUDA graph (no host time, host.py)
    traffic: Optional[Traffic] = None  # counted bytes of the memory-bound kernels (traffic.py; GPU plans only)
    turns: bool = False  # --overlap-moe-expert-parallel-comm: a forward beside the previous micro-batch's backward

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """The experts' data-parallel size."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def microbatches(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    @property
    def zero(self) -> int:
        return ZERO[self.sharding]

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation (--recompute-modules) recomputes ``module``."""
        return self.recompute == "selective" and module in self.recompute_modules

    @property
    def mixed(self) -> bool:
        """fp32 masters beside lower-precision weights."""
        return self.param_bytes < 4

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    def fp8_module(self, name: str) -> bool:
        """Whether an FP8 run's module ``name`` (Megatron's name) runs in FP8: not in a layer --first-last-layers-bf16
        keeps out, not kept in bf16 by --te-precision-config-file's first matching rule."""
        from ..config.precision_file import first_match
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"] and int(parts[2]) in self.bf16_layers:
            return False
        rule = first_match(self.fp8_rules, name)
        return rule is None or rule.recipe is not None

    def at(self, layer: int) -> "Layout":
        """The layout of decoder layer ``layer`` (global index): its paths those of a bf16 layer where
        --first-last-layers-bf16 keeps it out of FP8."""
        return self.replace(paths=self.paths.bf16) if layer in self.bf16_layers and self.paths.bf16 else self


def fp8_linear_weight(name: str) -> bool:
    """Whether tensor ``name`` is the weight of a decoder layer's linear that an FP8 run can run in FP8
    (paratron/fp8/recipe.py's LAYERS); ``Layout.fp8_module`` says whether it does."""
    from ..fp8.recipe import LAYERS
    return ".layers." in name and name.endswith(".weight") and name.split(".")[-2] in LAYERS


def field(cfg: Config, name: str, default):
    """A config field that may not exist in this version of paratron (a flag of another branch): its value,
    else ``default``."""
    return cfg.get(name) if name in FIELD_SECTION else default


def sharding_of(cfg: Config) -> str:
    given = field(cfg, "data_parallel_sharding_strategy", None)
    if given is not None and given != "no_shard":
        return given
    return "optim" if cfg.parallel.use_distributed_optimizer else "no_shard"


def precision_of(cfg: Config) -> tuple[int, int]:
    """(weight bytes, gradient-buffer bytes) of the run, by Megatron's rule for the gradient dtype."""
    tr, par = cfg.train, cfg.parallel
    if tr.bf16:
        return 2, 2 if par.grad_reduce_in_bf16 else 4
    if tr.fp16:
        return 2, 4 if par.accumulate_allreduce_grads_in_fp32 else 2
    return 4, 4


def layout_of(cfg: Config, kind: Optional[str] = None, host_ops: tuple = (0, 0),
              traffic: Optional[Traffic] = None) -> Layout:
    """The layout a resolved config runs, its layers' paths those of a ``kind`` GPU (paths.py; None: as resolved
    here); ``host_ops``: the eager operations of (one layer, the rest), counted by the caller
    (train/host_ops.host_ops_for; (0, 0): no host time); ``traffic``: the memory-bound kernels' bytes, counted by
    the caller (train/traffic.traffic_for; None: not counted)."""
    from ..fp8.recipe import Recipe, weight_cache_asked
    par, tr = cfg.parallel, cfg.train
    recipe, n = Recipe.from_config(tr), cfg.model.num_layers  # (which modules run in FP8: its rules and edges)
    param_bytes, grad_bytes = precision_of(cfg)
    offload = field(cfg, "optimizer_offload_fraction", 1.0) if field(cfg, "optimizer_cpu_offload", False) else 0.0
    moments = [field(cfg, name, "fp32") for name in ("exp_avg_dtype", "exp_avg_sq_dtype")]
    dp = cfg.data_parallel_size
    return Layout(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                  vpp=par.virtual_pipeline_model_parallel_size or 1, cp=par.context_parallel_size,
                  ep=par.expert_model_parallel_size,
                  etp=par.expert_tensor_parallel_size or par.tensor_model_parallel_size, dp=dp,
                  sequence_parallel=par.sequence_parallel and par.tensor_model_parallel_size > 1,
                  sharding=sharding_of(cfg), recompute=tr.recompute_granularity,
                  recompute_method=tr.recompute_method or "uniform",
                  recompute_num_layers=tr.recompute_num_layers if tr.recompute_granularity == "full" else None,
                  recompute_modules=tuple(tr.recompute_modules or ("core_attn",)),
                  micro_batch=tr.micro_batch_size, global_batch=tr.global_batch_size, seq_length=cfg.model.seq_length,
                  param_bytes=param_bytes, grad_bytes=grad_bytes, fp8=tr.fp8_format is not None,
                  fp8_param_gather=field(cfg, "fp8_param_gather", False), offload_fraction=offload,
                  fp8_weight_cache=weight_cache_asked(tr, cfg.kernels),
                  fp8_rules=recipe.overrides if recipe else (),
                  bf16_layers=frozenset(i for i in range(n) if recipe and recipe.in_bf16(i, n)),
                  moment_bytes=sum(MOMENT_BYTES[d] for d in moments),
                  scaled_moments=sum(d in ("fp16", "fp8") for d in moments),
                  offload_modules=tuple(field(cfg, "offload_modules", None) or ())
                  if field(cfg, "fine_grained_activation_offloading", False) else (),
                  activation_offload_fraction=field(cfg, "activation_offload_fraction", 1.0),
                  min_offloaded_tensor_size=field(cfg, "min_offloaded_tensor_size", 1048576),
                  bucket_size=par.ddp_bucket_size, overlap_grad_reduce=par.overlap_grad_reduce,
                  num_buckets=field(cfg, "ddp_num_buckets", None),
                  bucket_end_multiple=bucket_end_multiple(field(cfg, "ddp_pad_buckets_for_high_nccl_busbw", False)),
                  overlap_param_gather=par.overlap_param_gather, paths=paths_of(cfg, kind),
                  host_ops=host_ops, compiled=bool(tr.torch_compile), traffic=traffic,
                  step_graph=field(cfg, "cuda_graph_impl", "none") == "local",
                  turns=cfg.model.overlap_moe_expert_parallel_comm)
