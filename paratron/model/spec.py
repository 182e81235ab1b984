"""What each decoder layer is made of: one :class:`LayerSpec` per global layer, and the factory that
builds a layer's token mixer and MLP from it.

Megatron describes mixed stacks with two flags, whose values are parsed here:

* ``--moe-layer-freq``: an int k (layer i is MoE when ``i % k == 0``), or a Python list expression of
  0/1 entries such as ``([0]*1+[1]*3)*4`` (1 = MoE), one entry per layer;
* ``--hybrid-layer-pattern`` (or its deprecated name ``--hybrid-override-pattern``): one character per layer,
  ``M`` Mamba-2, ``G`` Gated DeltaNet, ``*`` attention, ``-`` MLP, ``E`` MoE (``|`` between pipeline stages).
  A hybrid layer is a mixer or an MLP, not both, each with its own norm and residual.

and ``--experimental-attention-variant gated_delta_net`` with ``--linear-attention-freq`` makes the mixer of
a GPT layer (mixer and MLP) Gated DeltaNet except on every Nth layer. :func:`layer_specs` reads these from the
model config (or takes parsed patterns as arguments).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

from ..config import ConfigError, ModelConfig
from ..config.layer_patterns import linear_attention_layers, parse_moe_layer_freq
from .gated_delta_net import GatedDeltaNet
from .layers import MLP, Attention, Parallel
from .mamba import MambaMixer
from .mla import MLASelfAttention

MIXERS = ("attention", "mamba", "gdn")
MLPS = ("dense", "moe")
# Megatron's hybrid symbols -> (mixer, mlp) of the layer.
HYBRID = {"M": ("mamba", None), "G": ("gdn", None), "*": ("attention", None), "-": (None, "dense"),
          "E": (None, "moe")}


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``index`` of the whole decoder (the i of ``decoder.layers.{i}`` in the one-stage model),
    its token mixer (attention | mamba | gdn) and its MLP (dense | moe); None where a hybrid layer has none."""
    index: int
    mixer: Optional[str] = "attention"
    mlp: Optional[str] = "dense"

    def __post_init__(self):
        if self.mixer not in MIXERS + (None,):
            raise ValueError(f"layer {self.index}: mixer {self.mixer!r} is not one of {MIXERS}")
        if self.mlp not in MLPS + (None,):
            raise ValueError(f"layer {self.index}: mlp {self.mlp!r} is not one of {MLPS}")
        if self.mixer is None and self.mlp is None:
            raise ValueError(f"layer {self.index} has neither a mixer nor an MLP")


def layer_specs(cfg: ModelConfig, moe_layers: Optional[Sequence[int]] = None,
                hybrid_layers: Optional[Sequence[str]] = None) -> list[LayerSpec]:
    """One spec per layer of ``cfg``: attention and a dense MLP unless ``moe_layers`` (0/1 per layer,
    see :func:`parse_moe_layer_freq`) or ``hybrid_layers`` (symbols per layer, see
    :func:`parse_hybrid_override_pattern`) say otherwise."""
    n = cfg.num_layers
    if moe_layers is not None and hybrid_layers is not None:
        raise ConfigError("--moe-layer-freq and --hybrid-override-pattern exclude each other "
                          "(a hybrid pattern places its MoE layers with E)")
    if hybrid_layers is None and moe_layers is None and cfg.hybrid_layer_pattern is not None:
        hybrid_layers = cfg.hybrid_layer_pattern
    if hybrid_layers is not None:
        return [LayerSpec(i, *HYBRID[s]) for i, s in enumerate(parse_hybrid_override_pattern(hybrid_layers, n))]
    if moe_layers is None and cfg.num_experts is not None:
        moe_layers = parse_moe_layer_freq(cfg.moe_layer_freq, n)
    moe = [0] * n if moe_layers is None else parse_moe_layer_freq(list(moe_layers), n)
    gdn = (linear_attention_layers(cfg.linear_attention_freq, n) if cfg.experimental_attention_variant is not None
           else [False] * n)
    return [LayerSpec(i, "gdn" if g else "attention", "moe" if m else "dense")
            for i, (m, g) in enumerate(zip(moe, gdn))]


def build_mixer(spec: LayerSpec, cfg: ModelConfig, par: Parallel, device=None, dtype=None) -> Optional[nn.Module]:
    """The token mixer of the layer ``spec`` describes (None if it has none)."""
    if spec.mixer is None:
        return None
    if spec.mixer == "attention":
        if cfg.multi_latent_attention:
            attention = MLASelfAttention(cfg, par, device, dtype)
            attention.layer_index = spec.index
            return attention
        return Attention(cfg, par, device, dtype, layer_index=spec.index)
    if spec.mixer == "mamba":
        return MambaMixer(cfg, par, device, dtype, layer_index=spec.index)
    return GatedDeltaNet(cfg, par, device, dtype, layer_index=spec.index)


def build_mlp(spec: LayerSpec, cfg: ModelConfig, par: Parallel, device=None, dtype=None) -> Optional[nn.Module]:
    """The MLP of the layer ``spec`` describes (None if it has none)."""
    if spec.mlp is None:
        return None
    if spec.mlp == "dense":
        return MLP(cfg, par, device, dtype)
    if cfg.num_experts is None:
        raise ConfigError(f"layer {spec.index} is a mixture-of-experts layer: set --num-experts")
    from .moe import MoELayer  # imported here: moe.py builds on layers.py as this module does
    return MoELayer(cfg, par, device, dtype, layer=spec.index)


# ----------------------------------------------------------------------------------------------
# Megatron's flag values
# ----------------------------------------------------------------------------------------------

def parse_hybrid_override_pattern(pattern: Union[str, Sequence[str]], num_layers: int) -> list[str]:
    """``--hybrid-layer-pattern`` -> its symbols, one per layer (M Mamba-2, G Gated DeltaNet, * attention, - MLP,
    E MoE; the pipeline boundaries ``|`` dropped)."""
    flag = "--hybrid-layer-pattern"
    symbols = [s for s in pattern if s != "|"]
    bad = sorted(set(symbols) - HYBRID.keys())
    if bad:
        raise ConfigError(f"{flag} {''.join(symbols)!r}: {bad} not among M (Mamba-2), G (Gated DeltaNet), "
                          "* (attention), - (MLP), E (MoE)")
    if len(symbols) != num_layers:
        raise ConfigError(f"{flag} {''.join(symbols)!r} has {len(symbols)} layers, --num-layers is {num_layers}")
    return symbols
