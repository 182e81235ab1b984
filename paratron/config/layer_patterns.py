"""Megatron's per-layer flag values, parsed without evaluating them: ``--moe-layer-freq``, ``--window-size``,
``--window-attn-skip-freq`` and ``--no-rope-freq`` (an int N or a list expression of 0/1 per layer). The
config checks them at resolve; the model reads them with the same functions."""
from __future__ import annotations

import ast
from typing import Optional, Sequence, Union

from ..errors import ConfigError


def parse_moe_layer_freq(value: Union[int, str, Sequence[int]], num_layers: int) -> list[int]:
    """``--moe-layer-freq`` -> 0/1 per layer (1 = MoE), as Megatron reads it.

    An int k (or its string) makes layers 0, k, 2k, ... MoE. A list, or a string holding a Python
    list expression (``[1,0,1,0]``, ``([0]*1+[1]*3)*4``), is the pattern itself and must have
    ``num_layers`` entries of 0 or 1. The string is parsed, never evaluated: list literals, integers,
    ``+``, ``*`` and parentheses are all it may contain."""
    flag = "--moe-layer-freq"
    if isinstance(value, str):
        value = list_expression(value, num_layers, flag)
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


def parse_window_size(value: Union[None, str, tuple, list]) -> Optional[tuple[int, int]]:
    """``--window-size`` -> (left, right), as Megatron's ``tuple_type`` reads "127,0" or "(127,0)"."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        parts = [p for p in str(value).strip().strip("()[]").split(",")]
    try:
        window = tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        raise ConfigError(f"--window-size {value!r}: expected two integers LEFT,RIGHT such as 127,0") from None
    if len(window) != 2:
        raise ConfigError(f"--window-size {value!r}: expected two integers LEFT,RIGHT such as 127,0")
    left, right = window
    if left < -1 or right < -1:
        raise ConfigError(f"--window-size {value!r}: sizes are >= 0, or -1 for unbounded")
    if right > 0:
        raise ConfigError(f"--window-size {value!r}: GPT attention is causal, so RIGHT must be 0 (or -1)")
    return left, right


def layer_pattern(value: Union[None, int, str, list], num_layers: int, flag: str) -> Union[int, list]:
    """Megatron's per-layer pattern flags: an int N (every Nth layer, counted from 1) or a list (or list
    expression) of 0/1 per layer, checked; returned as N or as a list of bools."""
    parsed = list_expression(value, num_layers, flag) if isinstance(value, str) else value
    if isinstance(parsed, bool) or not isinstance(parsed, (int, list, tuple)):
        raise ConfigError(f"{flag} {value!r}: expected an int or a list of 0/1 per layer")
    if isinstance(parsed, int):
        if parsed < 1:
            raise ConfigError(f"{flag} {parsed}: the frequency must be >= 1")
        return parsed
    if any(isinstance(v, bool) or v not in (0, 1) for v in parsed):
        raise ConfigError(f"{flag} {list(parsed)}: entries must be 0 or 1")
    if len(parsed) != num_layers:
        raise ConfigError(f"{flag} has {len(parsed)} entries, --num-layers is {num_layers}")
    return [bool(v) for v in parsed]


def linear_attention_layers(freq: Union[None, int, str, list], num_layers: int) -> list[bool]:
    """``--linear-attention-freq`` per global layer: whether it is a linear-attention (Gated DeltaNet) layer. An int
    N: every Nth layer (N, 2N, ... counted from 1) keeps softmax attention, the others are linear; a list (or list
    expression) of 0/1 per layer: 1 = linear (Megatron's reading)."""
    pattern = layer_pattern(freq, num_layers, "--linear-attention-freq")
    if isinstance(pattern, int):
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    return pattern


def window_layers(window_size, skip_freq: Union[None, int, str, list], num_layers: int) -> list[bool]:
    """Per global layer (0-based): whether it uses the window (Megatron's ``is_layer_window_attention``
    with the 1-based layer number). ``skip_freq`` None: every layer; an int N: every Nth layer
    (N, 2N, ... counted from 1) keeps full attention; a list (or list expression) of 0/1 per layer:
    1 = window, 0 = full."""
    if parse_window_size(window_size) is None:
        return [False] * num_layers
    if skip_freq is None:
        return [True] * num_layers
    pattern = layer_pattern(skip_freq, num_layers, "--window-attn-skip-freq")
    return pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]


def rope_layers(no_rope_freq: Union[None, int, str, list], num_layers: int) -> list[bool]:
    """Per global layer (0-based): whether it applies the rotary embedding (``--no-rope-freq``, Llama 4's
    NoPE layers): None: every layer; an int N: every Nth layer (counted from 1) skips it; a list of 0/1
    per layer: 1 = no RoPE."""
    if no_rope_freq is None:
        return [True] * num_layers
    pattern = layer_pattern(no_rope_freq, num_layers, "--no-rope-freq")
    if isinstance(pattern, list):
        return [not v for v in pattern]
    return [(i + 1) % pattern != 0 for i in range(num_layers)]


def list_expression(text: str, limit: int, flag: str) -> Union[int, list]:
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
