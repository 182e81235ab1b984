"""Megatron-LM's hybrid (Mamba) models in its checkpoints, both ways.

Megatron Core's ``MambaModel`` (``pretrain_mamba.py``, ``pretrain_hybrid.py``): the names and layouts in which its
checkpoints differ from paratron's hybrid stack (checkpoint/megatron.py reads the files, checkpoint/to_megatron.py
writes them).

Both number the layers along the pattern (``--hybrid-layer-pattern``, Megatron's ``--hybrid-override-pattern``).
Attention, MLP and MoE layers keep the GPT names. A Mamba layer's one mixing sublayer is ``mixer`` in Megatron Core
and ``self_attention`` in paratron:

| paratron | Megatron Core |
|---|---|
| ``self_attention.in_proj.weight`` | ``mixer.in_proj.weight`` (torch_dist: five tensors ``.z .x .B .C .dt``) |
| ``self_attention.conv1d_weight`` / ``conv1d_bias`` | ``mixer.conv1d.weight`` / ``.bias`` (torch_dist: ``.x .B .C``) |
| ``self_attention.`` ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj.weight`` | ``mixer.`` the same |
| ``input_layernorm.weight`` | ``mixer.in_proj.layer_norm_weight`` (Transformer Engine's name), ``norm.weight`` |
| ``decoder.final_layernorm.weight`` | ``decoder.final_norm.weight`` |

Under tensor parallelism each rank holds its share of each block of in_proj's rows (z, x, B, C, dt) and of the
convolution's channels (x, B, C), one after the other: the legacy format's rank files are merged block by block,
and torch_dist keeps each block as a tensor of its own.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Optional

import torch

from .hf_config import ConversionError

IN_PROJ = ("z", "x", "B", "C", "dt")  # in_proj's row blocks
CONV = ("x", "B", "C")  # the convolution's channel blocks
_MIXER = re.compile(r"^(.*?decoder\.layers\.\d+\.)mixer\.(.*)$")
_LAYER_NORM = re.compile(r"^(.*?decoder\.layers\.\d+\.)norm\.(.*)$")  # a Mamba layer's own norm (local spec)
_PART = re.compile(r"^(.*\.mixer\.(?:in_proj\.weight|conv1d\.weight|conv1d\.bias))\.(z|x|B|C|dt)$")
_BLOCKED = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias")
_CONV_NAME = r"conv1d_\1"  # paratron's conv1d_weight / conv1d_bias


def is_hybrid(args: dict) -> bool:
    """Whether Megatron's saved ``args`` are a hybrid model's."""
    return bool(args.get("is_hybrid_model") or args.get("hybrid_override_pattern") or
                args.get("hybrid_layer_pattern"))


def marked(args: dict, keys) -> dict:
    """``args``, marked as a hybrid model's (``is_hybrid_model``) where the checkpoint's tensor names ``keys`` hold
    Mamba mixers but the args no pattern: ``pretrain_mamba.py`` leaves the flag unset, and a stack given by
    --hybrid-attention-ratio / --hybrid-mlp-ratio alone (both 0: every layer Mamba-2) keeps no pattern."""
    if is_hybrid(args) or not any(".mixer." in k for k in keys):
        return args
    return {**args, "is_hybrid_model": True}


def mixer_blocks(args: dict) -> dict:
    """Global sizes of in_proj's and the convolution's blocks under Megatron's ``args`` ({} for a model with no
    Mamba layers): d_inner = heads x head size (heads: --mamba-num-heads, else 2 x hidden / head size)."""
    if not is_hybrid(args):
        return {}
    head_dim = int(args.get("mamba_head_dim") or 64)
    heads = int(args.get("mamba_num_heads") or 2 * int(args["hidden_size"]) // head_dim)
    inner, bc = heads * head_dim, int(args.get("mamba_num_groups") or 8) * int(args.get("mamba_state_dim") or 128)
    return {"in_proj": (inner, inner, bc, bc, heads), "conv": (inner, bc, bc)}


def _sizes(key: str, blocks: dict) -> tuple:
    return blocks["in_proj" if ".in_proj." in key else "conv"]


def merge_mixer(key: str, parts: list, blocks: dict) -> Optional[torch.Tensor]:
    """A legacy rank file's Mamba mixer tensor ``key`` over the TP ranks (``parts``, in TP order) -> the whole
    tensor; None where ``key`` is not a TP-split mixer tensor (the caller merges it as any other)."""
    if ".mixer." not in key or not blocks:
        return None
    if key.endswith(_BLOCKED):
        local = [size // len(parts) for size in _sizes(key, blocks)]
        if sum(local) != parts[0].shape[0]:
            raise ConversionError(f"{key}: {parts[0].shape[0]} rows on a rank, the args' Mamba sizes give "
                                  f"{sum(local)}")
        split = [p.split(local) for p in parts]
        return torch.cat([s[j] for j in range(len(local)) for s in split])
    if re.search(r"mixer\.(dt_bias|A_log|D|norm\.weight)$", key):
        return torch.cat(parts)
    if key.endswith("mixer.out_proj.weight"):
        return torch.cat(parts, dim=1)
    return None


def join_parts(state: dict) -> dict:
    """torch_dist's blocks of a mixer tensor (``mixer.in_proj.weight.z`` ...) -> the one tensor, blocks in order."""
    out, parts = {}, defaultdict(dict)
    for k, v in state.items():
        m = _PART.match(k)
        if m is None:
            out[k] = v
        else:
            parts[m.group(1)][m.group(2)] = v
    for k, by_block in parts.items():
        order = IN_PROJ if k.endswith("in_proj.weight") else CONV
        missing = [b for b in order if b not in by_block]
        if missing:
            raise ConversionError(f"{k}: the checkpoint has no {', '.join(k + '.' + b for b in missing)}")
        out[k] = torch.cat([by_block[b] for b in order])
    return out


def to_paratron_name(key: str) -> str:
    """Megatron Core's name of a hybrid model's tensor -> paratron's (others unchanged)."""
    if key.startswith("decoder.final_norm."):
        return "decoder.final_layernorm." + key[len("decoder.final_norm."):]
    m = _MIXER.match(key)
    if m is None:
        return _LAYER_NORM.sub(r"\1input_layernorm.\2", key)
    pre, rest = m.groups()
    if rest.startswith("in_proj.layer_norm_"):
        return f"{pre}input_layernorm.{rest[len('in_proj.layer_norm_'):]}"
    return f"{pre}self_attention.{re.sub(r'^conv1d[.](weight|bias)$', _CONV_NAME, rest)}"


def candidates(rest: str) -> list:
    """Megatron's names for the rest ``rest`` of a paratron layer key (after ``decoder.layers.<i>.``) where the layer
    is a Mamba layer (none for names that no Mamba layer has): the name :func:`megatron_rest` writes, and for the
    norm also the local spec's own module."""
    if rest.startswith("input_layernorm."):
        return [megatron_rest(rest), "norm." + rest[len("input_layernorm."):]]
    return [megatron_rest(rest)] if rest.startswith("self_attention.") else []


def block_pieces(piece, name: str, shapes: dict) -> Optional[list]:
    """``piece`` (paratron's, of the whole tensor whose Megatron name is ``name``) as pieces of the torch_dist blocks
    that hold its rows; None where the checkpoint keeps no blocks under ``name``."""
    from .pieces import Piece
    if not name.endswith(_BLOCKED):
        return None
    keys = [f"{name}.{b}" for b in (IN_PROJ if name.endswith("in_proj.weight") else CONV)]
    if not all(k in shapes for k in keys):
        return None
    lo, hi, out, start = piece.offsets[0], piece.offsets[0] + piece.tensor.shape[0], [], 0
    for k in keys:
        size = shapes[k][0]
        a, b = max(lo, start), min(hi, start + size)
        if a < b:  # (the rows a..b of the piece's tensor: a view, so loading writes through)
            out.append(Piece(k, (size, *piece.shape[1:]), (a - start, *piece.offsets[1:]), piece.tensor[a - lo:b - lo]))
        start += size
    if start != piece.shape[0]:
        raise ConversionError(f"{name}: its blocks hold {start} rows, the model's tensor {piece.shape[0]}")
    return out


# ----------------------------------------------------------------------------------------------
# Writing (paratron convert --to megatron)
# ----------------------------------------------------------------------------------------------

def megatron_rest(rest: str) -> str:
    """paratron's rest of a Mamba layer's key (after ``decoder.layers.<i>.``) -> Megatron's, its norm named as
    Transformer Engine's fused in_proj norm (the name Megatron's own hybrid spec saves)."""
    if rest.startswith("input_layernorm."):
        return "mixer.in_proj.layer_norm_" + rest[len("input_layernorm."):]
    if rest.startswith("self_attention.conv1d_"):
        return "mixer.conv1d." + rest[len("self_attention.conv1d_"):]
    return "mixer." + rest[len("self_attention."):]


def split_blocks(name: str, t: torch.Tensor, blocks: dict) -> dict:
    """{Megatron's torch_dist name: tensor} of the whole tensor ``t`` named ``name``: in_proj and the convolution
    as their blocks (``name.z`` ...), any other tensor as it is."""
    if not name.endswith(_BLOCKED):
        return {name: t}
    order = IN_PROJ if ".in_proj." in name else CONV
    return {f"{name}.{b}": part for b, part in zip(order, t.split(list(_sizes(name, blocks))))}


def to_megatron_names(state: dict, pattern: str, blocks: dict) -> tuple[dict, dict]:
    """(the Mamba layers' tensors, the MoE layers' norms and the final norm of paratron's ``state`` under Megatron's
    torch_dist names, the rest of ``state`` as it is: attention, MLP and MoE layers take the GPT names, but that
    Megatron's hybrid stack keeps an MoE layer's ``pre_mlp_layernorm`` as it is). ``state``'s keys may carry a
    prefix before ``decoder.`` (the optimizer's)."""
    symbols = pattern.replace("|", "")
    done, rest = {}, {}
    for k, v in state.items():
        m = re.match(r"^(.*?decoder\.layers\.)(\d+)\.(.*)$", k)
        final = re.match(r"^(.*?decoder\.)final_layernorm\.(.*)$", k)
        kind = symbols[int(m.group(2))] if m is not None else None
        if final is not None:
            done[f"{final.group(1)}final_norm.{final.group(2)}"] = v
        elif kind == "M":
            done.update(split_blocks(f"{m.group(1)}{m.group(2)}.{megatron_rest(m.group(3))}", v, blocks))
        elif kind == "E" and m.group(3).startswith("pre_mlp_layernorm."):  # (a norm of its own: no fc1 to fuse into)
            done[k] = v
        else:
            rest[k] = v
    return done, rest


def model_args(cfg) -> dict:
    """The fields of paratron's model config ``cfg`` that :func:`mixer_blocks` reads, as Megatron's args."""
    names = ("hidden_size", "mamba_head_dim", "mamba_num_heads", "mamba_num_groups", "mamba_state_dim")
    return {"is_hybrid_model": True, **{n: getattr(cfg, n) for n in names}}
