"""What each decoder layer is made of: one :class:`LayerSpec` per global layer, and the factory that
builds a layer's token mixer and MLP from it.

Megatron describes mixed stacks with two flags, whose values are parsed here:

* ``--moe-layer-freq``: an int k (layer i is MoE when ``i % k == 0``), or a Python list expression of
  0/1 entries such as ``([0]*1+[1]*3)*4`` (1 = MoE), one entry per layer;
* ``--hybrid-override-pattern``: one character per layer, ``M`` Mamba, ``*`` attention, ``-`` MLP,
  ``E`` MoE. A hybrid layer is a mixer or an MLP, not both, each with its own norm and residual.

:func:`layer_specs` places MoE layers by ``--moe-layer-freq`` when ``--num-experts`` is set (or by the
parsed patterns given as arguments); building a "mamba" part is a NotImplementedError (Mamba layers
do not exist yet).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

from ..config import ConfigError, ModelConfig
from .layers import MLP, Attention, Parallel

MIXERS = ("attention", "mamba")
MLPS = ("dense", "moe")
# Megatron's hybrid symbols -> (mixer, mlp) of the layer.
HYBRID = {"M": ("mamba", None), "*": ("attention", None), "-": (None, "dense"), "E": (None, "moe")}


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``index`` of the whole decoder (the i of ``decoder.layers.{i}`` in the one-stage model),
    its token mixer (attention | mamba) and its MLP (dense | moe); None where a hybrid layer has none."""
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
    if hybrid_layers is not None:
        return [LayerSpec(i, *HYBRID[s]) for i, s in enumerate(parse_hybrid_override_pattern(hybrid_layers, n))]
    if moe_layers is None and cfg.num_experts is not None:
        moe_layers = parse_moe_layer_freq(cfg.moe_layer_freq, n)
    moe = [0] * n if moe_layers is None else parse_moe_layer_freq(list(moe_layers), n)
    return [LayerSpec(i, "attention", "moe" if m else "dense") for i, m in enumerate(moe)]


def build_mixer(spec: LayerSpec, cfg: ModelConfig, par: Parallel, device=None, dtype=None) -> Optional[nn.Module]:
    """The token mixer of the layer ``spec`` describes (None if it has none)."""
    if spec.mixer is None:
        return None
    if spec.mixer == "attention":
        return Attention(cfg, par, device, dtype, layer_index=spec.index)
    raise NotImplementedError(f"layer {spec.index}: Mamba layers are not implemented in paratron yet")


def build_mlp(spec: LayerSpec, cfg: ModelConfig, par: Parallel, device=None, dtype=None) -> Optional[nn.Module]:
    """The MLP of the layer ``spec`` describes (None if it has none)."""
    if spec.mlp is None:
        return None
    if spec.mlp == "dense":
        return MLP(cfg, par, device, dtype)
    if cfg.num_experts is None:
        raise ConfigError(f"layer {spec.index} is a mixture-of-experts layer: set --num-experts")
    from .moe import MoELayer  # imported here: moe.py builds on layers.py as this module does
    return MoELayer(cfg, par, device, dtype)


# ----------------------------------------------------------------------------------------------
# Megatron's flag values
# ----------------------------------------------------------------------------------------------

def parse_moe_layer_freq(value: Union[int, str, Sequence[int]], num_layers: int) -> list[int]:
    """``--moe-layer-freq`` -> 0/1 per layer (1 = MoE), as Megatron reads it.

    An int k (or its string) makes layers 0, k, 2k, ... MoE. A list, or a string holding a Python
    list expression (``[1,0,1,0]``, ``([0]*1+[1]*3)*4``), is the pattern itself and must have
    ``num_layers`` entries of 0 or 1. The string is parsed, never evaluated: list literals, integers,
    ``+``, ``*`` and parentheses are all it may contain."""
    flag = "--moe-layer-freq"
    if isinstance(value, str):
        value = _list_expression(value, num_layers, flag)
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise ConfigError(f"{flag} {value!r}: expected an int or a list of 0/1 per layer")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{flag} {value}: the frequency must be >= 1")
        return [int(i % value == 0) for i in range(num_layers)]
    pattern = list(value)
    if any(isinstance(v, bool) or v not in (0, 1) for v in pattern):
        raise ConfigError(f"{flag} {pattern}: entries must be 0 (dense) or 1 (MoE)")
    if len(pattern) != num_layers:
        raise ConfigError(f"{flag} has {len(pattern)} entries, --num-layers is {num_layers}")
    return pattern


def parse_hybrid_override_pattern(pattern: Union[str, Sequence[str]], num_layers: int) -> list[str]:
    """``--hybrid-override-pattern`` -> its symbols, one per layer (M Mamba, * attention, - MLP, E MoE)."""
    flag = "--hybrid-override-pattern"
    symbols = list(pattern)
    bad = sorted(set(symbols) - HYBRID.keys())
    if bad:
        raise ConfigError(f"{flag} {''.join(symbols)!r}: {bad} not among M (Mamba), * (attention), - (MLP), E (MoE)")
    if len(symbols) != num_layers:
        raise ConfigError(f"{flag} {''.join(symbols)!r} has {len(symbols)} layers, --num-layers is {num_layers}")
    return symbols


def _list_expression(text: str, limit: int, flag: str) -> Union[int, list]:
    """The value of ``text`` made of int and list literals, + and *; lists longer than ``limit`` are
    refused while being built (so ``[1]*10**12``-like input costs nothing)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ConfigError(f"{flag} {text!r} is neither an int nor a list expression") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            kinds = {type(a), type(b)}
            if isinstance(node.op, ast.Add) and len(kinds) == 1:  # int + int, list + list
                out = a + b
            elif isinstance(node.op, ast.Mult) and kinds == {int}:
                out = a * b
            elif isinstance(node.op, ast.Mult) and kinds == {int, list}:  # list * int, int * list
                seq, times = (a, b) if isinstance(a, list) else (b, a)
                if len(seq) * times > limit:
                    raise ConfigError(f"{flag} {text!r} has more entries than the {limit} layers")
                out = seq * times
            else:
                raise ConfigError(f"{flag} {text!r}: cannot apply {type(node.op).__name__} to these operands")
            if isinstance(out, list) and len(out) > limit:
                raise ConfigError(f"{flag} {text!r} has more entries than the {limit} layers")
            return out
        raise ConfigError(f"{flag} {text!r}: only int and list literals, + and * are allowed")

    return value(tree.body)
