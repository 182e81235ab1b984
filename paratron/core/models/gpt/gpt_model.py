"""Megatron Core's ``GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, ...)``:
paratron's GPTModel built from the facade's TransformerConfig, layer spec and the ParallelDims of
``parallel_state``, with Megatron's forward signature and ``sharded_state_dict()``.

It IS a ``paratron.model.gpt.GPTModel`` (same parameters, names and numbers): ``model.config`` is the
resolved paratron ModelConfig (its field names match Megatron's for the shape: ``num_layers``,
``hidden_size``, ...), ``model.transformer_config`` the TransformerConfig it was given, ``model.dims``
the ParallelDims. With pipeline parallelism each stage holds an even share of the layers (Megatron's
default split), chunk ``vp_stage`` of an interleaved schedule the virtual stage ``vp_stage x PP + rank``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ....checkpoint.state import param_keys
from ....config import ConfigError
from ....config.check_moe import check_combined_overlap
from ....model import recompute
from ....model.gpt import GPTModel as _GPTModel
from ....parallel.sharding import REPLICATED, coords_of, spec_of
from ....parallel.stages import global_name
from ...dist_checkpointing.mapping import ShardedTensor
from ...parallel_state import COMPAT
from .gpt_layer_specs import LayerSpec, get_gpt_layer_local_spec

DEFAULT_SEED = 1234  # Megatron's --seed, when model_parallel_cuda_manual_seed was not called


def _stage_layers(num_layers: int, dims, vp_stage: Optional[int]) -> tuple[int, int]:
    """(first layer, layer count) of this pipeline stage (chunk ``vp_stage``) under an even split."""
    chunks = dims.pp * (dims.vpp or 1)
    if num_layers % chunks:
        raise ConfigError(f"num_layers {num_layers} does not split evenly over pipeline size {dims.pp} x virtual "
                          f"size {dims.vpp or 1}; use paratron's own GPTModel for uneven splits")
    per = num_layers // chunks
    return ((vp_stage or 0) * dims.pp + dims.pp_rank) * per, per


def build_kwargs(config, model_cfg, pre_process: bool, post_process: bool, vp_stage: Optional[int]) -> dict:
    """What a facade model passes paratron's model beside its config: the ParallelDims of ``parallel_state``, this
    pipeline chunk's layers, the seed, recomputation, the kernel switches, the device and dtype."""
    dims = COMPAT.require()
    # the combined overlap's rules that the model and parallel_state decide (the sharding: at the DDP wrapper)
    check_combined_overlap(model_cfg, expert_ranks=dims.ep * dims.etp, sharding_strategy=None,
                           recompute_granularity=config.recompute_granularity)
    offset, count = _stage_layers(model_cfg.num_layers, dims, vp_stage)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return dict(dims=dims, sequence_parallel=config.sequence_parallel,
                seed=COMPAT.seed if COMPAT.seed is not None else DEFAULT_SEED, pre_process=pre_process,
                post_process=post_process, layer_offset=offset, num_layers=count,
                recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers,
                kernels=config.kernel_config(device, config.params_dtype), device=device, dtype=config.params_dtype)


class GPTModel(_GPTModel):
    def __init__(self, config, transformer_layer_spec: Optional[LayerSpec] = None, vocab_size: int = 0,
                 max_sequence_length: int = 0, pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False, position_embedding_type: str = "learned_absolute",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True,
                 seq_len_interpolation_factor: Optional[float] = None, mtp_block_spec=None,
                 vp_stage: Optional[int] = None, **_megatron_only):
        if not parallel_output or fp16_lm_cross_entropy:
            raise ConfigError("GPTModel(parallel_output=False / fp16_lm_cross_entropy=True) is not supported by "
                              "paratron.core: logits stay split over tensor-parallel ranks")
        spec = transformer_layer_spec if transformer_layer_spec is not None else get_gpt_layer_local_spec()
        rope = {"rotary_percent": rotary_percent, "rotary_base": float(rotary_base), "use_rope_scaling": rope_scaling,
                "rope_scaling_factor": rope_scaling_factor,
                "rotary_seq_len_interpolation_factor": seq_len_interpolation_factor}
        model_cfg = config.model_config(max_sequence_length, **spec.model_fields(config),
                                        position_embedding_type=position_embedding_type,
                                        untie_embeddings_and_output_weights=not share_embeddings_and_output_weights,
                                        **(rope if position_embedding_type in ("rope", "yarn") else {}))
        train = config.train_section(model_cfg)  # (checked before anything is built)
        kwargs = build_kwargs(config, model_cfg, pre_process, post_process, vp_stage)
        super().__init__(model_cfg, vocab_size, max_sequence_length, **kwargs)
        recompute.apply_train_choices(self.decoder, train, kwargs["device"] or "cpu")
        self.transformer_config = config

    def forward(self, input_ids, position_ids=None, attention_mask=None, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None,
                *, inference_params=None, loss_mask=None, document_ids=None):
        """Megatron's signature (``labels`` is the fifth argument there); the per-token loss [b, s] with
        labels, else this rank's logits [b, s, vocab / TP]. ``document_ids`` is paratron's packed-sequence input."""
        given = [n for n, v in (("decoder_input", decoder_input), ("inference_context", inference_context),
                                ("packed_seq_params", packed_seq_params), ("inference_params", inference_params),
                                ("extra_block_kwargs", extra_block_kwargs)) if v is not None]
        if given:
            raise ConfigError(f"GPTModel.forward({given[0]}=...) is not supported by paratron.core")
        return super().forward(input_ids, position_ids, attention_mask, labels, document_ids, loss_mask)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """{prefix + state-dict key: ShardedTensor}: each tensor of ``state_dict()`` with its name in the
        one-rank model and its place there, for ``dist_checkpointing.save`` / ``load`` (any layout)."""
        if sharded_offsets:
            raise ConfigError("sharded_state_dict(sharded_offsets=...) is not supported by paratron.core")
        keys = param_keys([self])
        out = {}
        for name, t in self.state_dict(keep_vars=True).items():
            key = keys.get(t) if isinstance(t, torch.nn.Parameter) else None
            spec = spec_of(t) if key is not None else REPLICATED
            key = key if key is not None else global_name(name, self.decoder.layer_offset)
            out[prefix + name] = ShardedTensor("model." + key, t.detach(), spec, coords_of(spec, self.dims))
        return out
