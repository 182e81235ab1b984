"""Megatron Core's layer-spec functions. Megatron's spec names the module classes of a layer; paratron's
layers are chosen by the model config (and its kernels by paratron's switches), so a spec here records
the options it was asked for, and the facade's GPTModel applies them to the config: MoE layers,
q/k layernorm, multi-latent attention, the normalization. Both functions give the same kind of spec
(there is no Transformer Engine: paratron's own kernels run either way)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....config import ConfigError


@dataclass(frozen=True)
class LayerSpec:
    """What a Megatron layer spec decides about the model (None: the TransformerConfig decides)."""
    num_experts: Optional[int] = None
    moe_grouped_gemm: bool = False
    qk_layernorm: bool = False
    multi_latent_attention: bool = False
    normalization: Optional[str] = None

    def model_fields(self, config) -> dict:
        """The ModelConfig fields the spec adds to ``config`` (the facade's TransformerConfig)."""
        out = {}
        if self.num_experts is not None:
            if config.num_moe_experts not in (None, self.num_experts):
                raise ConfigError(f"layer spec for {self.num_experts} experts with TransformerConfig("
                                  f"num_moe_experts={config.num_moe_experts})")
            out.update(num_experts=self.num_experts, moe_grouped_gemm=self.moe_grouped_gemm or config.moe_grouped_gemm)
        if self.qk_layernorm:
            out["qk_layernorm"] = True
        if self.multi_latent_attention:
            out["multi_latent_attention"] = True
        if self.normalization is not None:
            out["normalization"] = self.normalization
        return out


def get_gpt_layer_local_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, multi_latent_attention: bool = False,
                             fp8: Optional[str] = None, moe_use_legacy_grouped_gemm: bool = False,
                             normalization: Optional[str] = None, qk_l2_norm: bool = False,
                             use_kitchen: bool = False, **_others) -> LayerSpec:
    """Megatron's signature; returns the spec paratron's GPTModel facade takes."""
    if fp8 or qk_l2_norm or use_kitchen:
        given = "fp8" if fp8 else "qk_l2_norm" if qk_l2_norm else "use_kitchen"
        raise ConfigError(f"get_gpt_layer_local_spec({given}=...) is not supported by paratron.core")
    return LayerSpec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, normalization)


def get_gpt_layer_with_transformer_engine_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                                               qk_layernorm: bool = False, multi_latent_attention: bool = False,
                                               fp8: Optional[str] = None, **others) -> LayerSpec:
    """The same spec as :func:`get_gpt_layer_local_spec` (paratron has no Transformer Engine layers)."""
    return get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8, **others)
