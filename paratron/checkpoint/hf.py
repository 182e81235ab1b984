"""Hugging Face <-> paratron checkpoint conversion (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE,
DeepSeek-V3; Mamba-2, Nemotron-H and Qwen3-Next hybrid stacks in :mod:`paratron.checkpoint.hf_hybrid`).

The whole mapping is one fixed table (:func:`name_table`): every paratron tensor has one row naming
the Hugging Face tensor(s) it comes from and how it is reshaped. Most rows are plain copies; the few
reshapes are small functions in this file:

* ``conv1d``  GPT-2's ``Conv1D`` stores ``[in, out]``; paratron (``nn.Linear``) stores ``[out, in]``:
  a transpose (1-D biases are copied).
* ``c_attn``  GPT-2's fused ``c_attn`` is ``[q | k | v]`` along its output; paratron's ``linear_qkv`` is
  laid out by query group (:func:`fuse_qkv`), so the three blocks are split and regrouped.
* ``qkv``     Llama-style separate ``q_proj``/``k_proj``/``v_proj`` <-> the grouped fused ``linear_qkv``.
* ``gate_up`` ``gate_proj`` and ``up_proj`` stacked as paratron's SwiGLU ``linear_fc1`` = ``[gate; up]``.
* ``vocab``   embedding / output rows: Hugging Face has exactly ``vocab_size`` rows, paratron the padded
  size; converting to paratron appends zero rows, converting back drops them.
* ``experts`` / ``experts_gate_up``  one Hugging Face tensor per expert <-> paratron's stacked expert
  tensors (:mod:`paratron.checkpoint.hf_moe`, which also reads transformers 5's fused in-memory experts).

Everything here works on plain ``{name: tensor}`` dicts of a full (TP=1, single pipeline stage)
model, reads and writes local files only, and never imports ``transformers``. The config.json <->
ModelConfig mapping (and :class:`~paratron.checkpoint.hf_config.ConversionError`) is in
:mod:`paratron.checkpoint.hf_config`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from ..model.gpt import GPTModel
from .hf_config import ConversionError, check_family, check_representable, hf_config_from_model_config
from .hf_deepseek import deepseek_layer_rows
from .families import HYBRID_FAMILIES
from .hf_hybrid import (HYBRID_RESHAPES, gated_qkv_to_hf, gated_qkv_to_paratron, hybrid_hf_shapes,
                        hybrid_rows, qkvz_ba_to_hf, qkvz_ba_to_paratron)
from .hf_moe import (MOE_FAMILIES, moe_layer_rows, per_expert_state, stack_expert_gate_up, stack_experts,
                     unstack_expert_gate_up, unstack_experts)

__all__ = [
    "name_table", "hf_to_paratron", "paratron_to_hf", "save_hf_dir", "load_hf_dir",
    "fuse_qkv", "split_qkv", "c_attn_to_qkv", "qkv_to_c_attn", "fuse_gate_up", "split_gate_up",
]


# ----------------------------------------------------------------------------------------------
# The name table
# ----------------------------------------------------------------------------------------------

# (paratron name inside a block, Hugging Face name(s) inside a block, reshape)
_GPT2_LAYER = [
    ("input_layernorm.weight", ("ln_1.weight",), "copy"),
    ("input_layernorm.bias", ("ln_1.bias",), "copy"),
    ("self_attention.linear_qkv.weight", ("attn.c_attn.weight",), "c_attn"),
    ("self_attention.linear_qkv.bias", ("attn.c_attn.bias",), "c_attn"),
    ("self_attention.linear_proj.weight", ("attn.c_proj.weight",), "conv1d"),
    ("self_attention.linear_proj.bias", ("attn.c_proj.bias",), "copy"),
    ("pre_mlp_layernorm.weight", ("ln_2.weight",), "copy"),
    ("pre_mlp_layernorm.bias", ("ln_2.bias",), "copy"),
    ("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), "conv1d"),
    ("mlp.linear_fc1.bias", ("mlp.c_fc.bias",), "copy"),
    ("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), "conv1d"),
    ("mlp.linear_fc2.bias", ("mlp.c_proj.bias",), "copy"),
]
_GPT2_TOP = [
    ("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"),
    ("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "copy"),
    ("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), "copy"),
    ("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
]

# Llama, Mistral, Qwen2 and Qwen3 share names; each uses the rows its configuration has tensors for
# (biases only where the config has them, q_norm/k_norm only in Qwen3).
_LLAMA_LAYER = [
    ("input_layernorm.weight", ("input_layernorm.weight",), "copy"),
    ("self_attention.linear_qkv.weight",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    ("self_attention.linear_qkv.bias",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy"),
    ("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "copy"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy"),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    ("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "gate_up"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy"),
    ("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), "copy"),
]
_LLAMA_TOP = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
]

_TABLES = {"gpt2": (_GPT2_TOP, "transformer.h.{i}.", _GPT2_LAYER)}
for _fam in ("llama", "mistral", "qwen2", "qwen3") + MOE_FAMILIES:
    _TABLES[_fam] = (_LLAMA_TOP, "model.layers.{i}.", _LLAMA_LAYER)
_TABLES["deepseek_v3"] = (_LLAMA_TOP, "model.layers.{i}.", _LLAMA_LAYER + deepseek_layer_rows())


def _paratron_shapes(cfg: ModelConfig, padded_vocab: int) -> dict[str, tuple]:
    """Every tensor of GPTModel(cfg, padded_vocab).state_dict() at TP=1, with its shape, in state-dict
    order: read off the model itself, built on the meta device (no memory, no initialisation)."""
    model = GPTModel(cfg, padded_vocab, device="meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def name_table(cfg: ModelConfig, family: str) -> list[tuple[str, tuple[str, ...], str]]:
    """The mapping for one model: ``(paratron name, Hugging Face names, reshape)`` for every paratron
    tensor, in state-dict order. Reshape is one of copy, conv1d, c_attn, qkv, gate_up, vocab, experts,
    experts_gate_up. (A Qwen3-MoE layer has the dense or the MoE rows, as paratron's layer has.)"""
    check_family(family)
    check_representable(cfg, family)
    if family in HYBRID_FAMILIES:
        by_name = hybrid_rows(cfg, family)
    else:
        top, layer_prefix, layer = _TABLES[family]
        if cfg.num_experts is not None:
            layer = layer + moe_layer_rows(cfg, family)
        by_name = {p: (hf, how) for p, hf, how in top}
        for i in range(cfg.num_layers):
            hp = layer_prefix.format(i=i)
            for p, hf, how in layer:
                by_name[f"decoder.layers.{i}.{p}"] = (tuple(hp + n for n in hf), how)
    rows = []
    for p in _paratron_shapes(cfg, 1):
        if p not in by_name:  # check_representable should make this unreachable
            raise ConversionError(f"{family} has no tensor for paratron's {p}")
        rows.append((p, *by_name[p]))
    return rows


# ----------------------------------------------------------------------------------------------
# Reshaping functions
# ----------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k and v [groups*d, ...] -> paratron's fused rows, laid out by query
    group: for each group its heads/groups query heads, then its key head, then its value head."""
    d = q.shape[0] // num_heads
    rest = q.shape[1:]
    qg = q.reshape(num_groups, num_heads // num_groups, d, *rest)
    kg = k.reshape(num_groups, 1, d, *rest)
    vg = v.reshape(num_groups, 1, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_groups) * d, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: paratron's grouped fused rows -> (q, k, v)."""
    per = num_heads // num_groups + 2
    d = qkv.shape[0] // (num_groups * per)
    rest = qkv.shape[1:]
    g = qkv.reshape(num_groups, per, d, *rest)
    q = g[:, : per - 2].reshape(num_heads * d, *rest)
    k = g[:, per - 2].reshape(num_groups * d, *rest)
    v = g[:, per - 1].reshape(num_groups * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def c_attn_to_qkv(c_attn: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GPT-2 ``c_attn`` (Conv1D weight [h, 3h] or bias [3h], columns q|k|v) -> paratron linear_qkv."""
    t = c_attn.t() if c_attn.dim() == 2 else c_attn
    q, k, v = t.chunk(3, dim=0)
    return fuse_qkv(q, k, v, num_heads, num_heads).contiguous()


def qkv_to_c_attn(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`c_attn_to_qkv`."""
    t = torch.cat(split_qkv(qkv, num_heads, num_heads), dim=0)
    return (t.t() if t.dim() == 2 else t).contiguous()


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's gate_proj and up_proj -> paratron's SwiGLU linear_fc1 ([gate; up] along rows)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _to_paratron(how: str, ts: list, cfg: ModelConfig, padded_vocab: int) -> torch.Tensor:
    if how in HYBRID_RESHAPES:
        return (qkvz_ba_to_paratron if how == "qkvz_ba" else gated_qkv_to_paratron)(*ts, cfg)
    if how == "copy":
        return ts[0]
    if how == "conv1d":
        return ts[0].t() if ts[0].dim() == 2 else ts[0]
    if how == "c_attn":
        return c_attn_to_qkv(ts[0], cfg.num_attention_heads)
    if how == "qkv":
        return fuse_qkv(*ts, cfg.num_attention_heads, cfg.num_query_groups)
    if how == "gate_up":
        return fuse_gate_up(*ts)
    if how == "vocab":
        return _pad_rows(ts[0], padded_vocab)
    if how == "experts":
        return stack_experts(ts)
    if how == "experts_gate_up":
        return stack_expert_gate_up(ts)
    raise AssertionError(how)


def _to_hf(how: str, t: torch.Tensor, cfg: ModelConfig, vocab_size: int) -> list:
    if how in HYBRID_RESHAPES:
        return (qkvz_ba_to_hf if how == "qkvz_ba" else gated_qkv_to_hf)(t, cfg)
    if how == "copy":
        return [t]
    if how == "conv1d":
        return [t.t() if t.dim() == 2 else t]
    if how == "c_attn":
        return [qkv_to_c_attn(t, cfg.num_attention_heads)]
    if how == "qkv":
        return list(split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups))
    if how == "gate_up":
        return list(split_gate_up(t))
    if how == "vocab":
        return [t[:vocab_size]]
    if how == "experts":
        return unstack_experts(t)
    if how == "experts_gate_up":
        return unstack_expert_gate_up(t)
    raise AssertionError(how)


def _hf_shapes(how: str, pshape: tuple, cfg: ModelConfig, vocab_size: int) -> list[tuple]:
    """The Hugging Face shapes that a paratron tensor of shape ``pshape`` comes from."""
    rest = tuple(pshape[1:])
    d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    if how in HYBRID_RESHAPES:
        return hybrid_hf_shapes(how, pshape, cfg)
    if how == "copy":
        return [tuple(pshape)]
    if how == "conv1d":
        return [tuple(reversed(pshape))]
    if how == "c_attn":
        return [(rest[0], pshape[0])] if rest else [tuple(pshape)]
    if how == "qkv":
        return [(heads * d, *rest), (groups * d, *rest), (groups * d, *rest)]
    if how == "gate_up":
        return [(pshape[0] // 2, *rest)] * 2
    if how == "vocab":
        return [(vocab_size, *rest)]
    if how == "experts":
        return [rest] * pshape[0]
    if how == "experts_gate_up":
        return [(rest[0] // 2, *rest[1:])] * (2 * pshape[0])
    raise AssertionError(how)


# ----------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------

def _names(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _normalize_hf_names(hf_state: dict, family: str, tied: bool) -> dict:
    """Accept the variants found in published checkpoints: GPT-2 without the ``transformer.`` prefix
    and with its causal-mask buffers (``attn.bias``/``attn.masked_bias``), old Llama ``rotary_emb.inv_freq``
    buffers, ``lm_head.weight`` stored next to tied embeddings (transformers ignores it then too), NemotronH's
    in-memory ``model.*`` names (its files' ``backbone.*``), and transformers 5's fused in-memory experts
    (:func:`~paratron.checkpoint.hf_moe.per_expert_state`)."""
    if family in MOE_FAMILIES + ("deepseek_v3", "qwen3_next", "nemotron_h"):
        hf_state = per_expert_state(hf_state, family)
    out = {}
    bare_gpt2 = family == "gpt2" and "transformer.wte.weight" not in hf_state and "wte.weight" in hf_state
    for name, t in hf_state.items():
        if family == "nemotron_h" and name.startswith("model."):  # transformers' in-memory names
            name = "backbone." + name[len("model."):]
        if bare_gpt2 and not name.startswith("lm_head."):
            name = "transformer." + name
        if family == "gpt2" and (name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")):
            continue
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        out[name] = t
    return out


def hf_to_paratron(hf_state: dict, cfg: ModelConfig, family: str, padded_vocab_size: int,
                   vocab_size: Optional[int] = None) -> dict:
    """A Hugging Face state dict -> a state dict for ``GPTModel(cfg, padded_vocab_size)`` at TP=1.
    ``vocab_size``: config.json's, which must be the embedding's rows (as transformers requires).

    Embedding (and untied output) rows beyond the Hugging Face vocabulary are zeros. Tensors keep
    their dtype and copied ones may share memory with ``hf_state``. For tied models a stored
    ``lm_head.weight`` is ignored, as transformers does. Raises ConversionError naming missing,
    unexpected or mis-shaped tensors.
    """
    cfg = cfg.resolved()  # derived sizes filled (a copy when the caller's is not resolved)
    rows = name_table(cfg, family)
    hf = _normalize_hf_names(hf_state, family, not cfg.untie_embeddings_and_output_weights)
    wanted = {n for _, names, _ in rows for n in names}
    missing = wanted - hf.keys()
    if missing:
        raise ConversionError(f"{family} state dict is missing {len(missing)} tensor(s): {_names(missing)}")
    extra = hf.keys() - wanted
    if extra:
        raise ConversionError(f"{family} state dict has {len(extra)} tensor(s) this config does not use: "
                              f"{_names(extra)}; the config and the weights do not match")
    vocab_rows = {hf[names[0]].shape[0] for _, names, how in rows if how == "vocab"}
    if len(vocab_rows) != 1:
        raise ConversionError(f"embedding and output layer have different vocabulary sizes {sorted(vocab_rows)}")
    vocab = vocab_rows.pop()
    if vocab_size is not None and vocab != vocab_size:
        raise ConversionError(f"config.json has vocab_size {vocab_size} but the {family} embedding has {vocab} rows; "
                              "the config and the weights do not match (transformers refuses them too)")
    if vocab > padded_vocab_size:
        raise ConversionError(f"vocabulary of {vocab} rows does not fit padded_vocab_size {padded_vocab_size}")
    shapes = _paratron_shapes(cfg, padded_vocab_size)
    out = {}
    for pname, names, how in rows:
        expect = _hf_shapes(how, shapes[pname], cfg, vocab)
        for n, e in zip(names, expect):
            if tuple(hf[n].shape) != e:
                raise ConversionError(f"shape mismatch for {n}: got {tuple(hf[n].shape)}, the config gives {e}")
        out[pname] = _to_paratron(how, [hf[n] for n in names], cfg, padded_vocab_size).contiguous()
    return out


def paratron_to_hf(state: dict, cfg: ModelConfig, family: str, vocab_size: int) -> dict:
    """A TP=1 paratron state dict -> the full Hugging Face state dict, vocabulary unpadded.

    For tied models ``lm_head.weight`` is left out, as ``save_pretrained`` does (``from_pretrained``
    ties it to the embedding); an ``output_layer.weight`` copy in a tied state dict is ignored.
    """
    cfg = cfg.resolved()
    rows = name_table(cfg, family)
    if not cfg.untie_embeddings_and_output_weights:
        state = {k: v for k, v in state.items() if k != "output_layer.weight"}
    emb = state.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError("paratron state dict has no embedding.word_embeddings.weight")
    padded = emb.shape[0]
    if vocab_size > padded:
        raise ConversionError(f"vocab_size {vocab_size} is larger than the embedding's {padded} rows")
    shapes = _paratron_shapes(cfg, padded)
    missing, extra = shapes.keys() - state.keys(), state.keys() - shapes.keys()
    if missing:
        raise ConversionError(f"paratron state dict is missing {len(missing)} tensor(s): {_names(missing)}")
    if extra:
        raise ConversionError(f"paratron state dict has {len(extra)} tensor(s) this config does not use: "
                              f"{_names(extra)}; the config and the weights do not match")
    out = {}
    for pname, names, how in rows:
        if tuple(state[pname].shape) != shapes[pname]:
            raise ConversionError(f"shape mismatch for {pname}: got {tuple(state[pname].shape)}, "
                                  f"the config gives {shapes[pname]}")
        for n, t in zip(names, _to_hf(how, state[pname], cfg, vocab_size)):
            out[n] = t.contiguous()
    return out


# ----------------------------------------------------------------------------------------------
# Directories
# ----------------------------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _standalone(tensors: dict) -> dict:
    """Contiguous CPU tensors that share no storage (safetensors refuses shared or partial storage)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            storage = t.untyped_storage()
        seen.add(storage.data_ptr())
        out[name] = t
    return out


def current_umask() -> int:
    """The process's file-creation mask (read from /proc on Linux; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_hf_dir(path, state: dict, cfg: ModelConfig, family: str, vocab_size: int,
                dtype: Optional[torch.dtype] = None, extra_config: Optional[dict] = None) -> Path:
    """Write a Hugging Face model directory: ``model.safetensors`` and ``config.json``.

    ``dtype`` casts floating-point tensors (default: keep them); ``extra_config`` is merged into
    config.json (e.g. ``{"eos_token_id": 50256}``). Returns the directory.
    """
    emb_name = ("transformer.wte.weight" if family == "gpt2" else "backbone.embeddings.weight"
                if family in ("mamba2", "nemotron_h") else "model.embed_tokens.weight")
    return write_hf_dir(path, paratron_to_hf(state, cfg, family, vocab_size),
                        hf_config_from_model_config(cfg, vocab_size, family), emb_name, dtype, extra_config)


def write_hf_dir(path, hf: dict, config: dict, dtype_of: str, dtype: Optional[torch.dtype] = None,
                 extra_config: Optional[dict] = None) -> Path:
    """``hf`` (Hugging Face tensors) as ``model.safetensors`` and ``config`` (with ``torch_dtype``: the dtype of
    tensor ``dtype_of``, and ``extra_config`` merged) as ``config.json`` in the new or empty directory ``path``."""
    from safetensors.torch import save_file

    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = [f for f in _WEIGHT_FILES[1:] if (out_dir / f).exists()]
    if stale:
        raise ConversionError(f"{out_dir} already holds {', '.join(stale)}; save into an empty directory")
    if dtype is not None:
        hf = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in hf.items()}
    hf = _standalone(hf)
    config = dict(config, torch_dtype=_dtype_name(hf[dtype_of].dtype))
    config.update(extra_config or {})
    save_file(hf, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o666 & ~current_umask())  # safetensors writes 0600
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_hf_dir(path) -> tuple[dict, dict]:
    """Read a local Hugging Face model directory -> (state dict, config.json dict). Reads
    model.safetensors, a sharded safetensors index, or pytorch_model.bin (``weights_only=True``)."""
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise ConversionError(f"{d} is not a directory; pass a local Hugging Face model directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ConversionError(f"{d} has no config.json")
    config = json.loads(cfg_file.read_text())

    def load_bin(f: Path) -> dict:
        return torch.load(f, map_location="cpu", weights_only=True)

    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors")), config
    if (d / "pytorch_model.bin").is_file() and not (d / "model.safetensors.index.json").is_file():
        return load_bin(d / "pytorch_model.bin"), config
    for index, loader in (("model.safetensors.index.json", lambda f: load_file(str(f))),
                          ("pytorch_model.bin.index.json", load_bin)):
        if (d / index).is_file():
            weight_map = json.loads((d / index).read_text()).get("weight_map", {})
            state = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise ConversionError(f"{d / index} names shard {shard}, which is not in {d}")
                state.update(loader(d / shard))
            return state, config
    raise ConversionError(f"{d} has no weights: expected one of {', '.join(_WEIGHT_FILES)}")
