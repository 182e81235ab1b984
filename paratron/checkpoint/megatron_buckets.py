"""Megatron-LM's distributed optimizer state in its default torch_dist layout, ``dp_reshardable``, read into this run.

Megatron saves that state as its gradient buffers: one 1-D tensor per bucket,
``[chained_{i}.]optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{b}.dtype_{dtypes}.bucket_idx_{k}.{param|exp_avg|
exp_avg_sq}``, the concatenation over its data-parallel ranks of each rank's shard, cut to the bucket's unpadded size.
``g`` is the rank in the model-parallel group (TP rank + TP x PP rank; for the routed experts, held by a second
optimizer ``chained_1``, the rank in the expert-TP x EP x PP group), ``b`` the model chunk (virtual pipeline stage).
Inside a bucket the parameters lie in the reverse order of Megatron Core's ``named_parameters()`` of the chunk, each
starting at a multiple of 64 elements; a bucket ends where a parameter ends (or, before the shared embedding, at the
next aligned start). The tensors are not in the model's shape, so, as in Megatron, only the same tensor, pipeline
and expert layout reads them (any data-parallel size does).

paratron's parameters are Megatron Core's, one by one, but for the order inside the attention block (Megatron
registers ``linear_proj`` before ``linear_qkv``) and the routed experts, which paratron stacks: Megatron's
``SequentialMLP`` holds ``local_experts.{e}.linear_fc1/2`` one expert after the other, its grouped linear all of
``linear_fc1`` then all of ``linear_fc2``. :func:`pieces` lays this rank's parameters out so, and reads each range of
its optimizer shards from the bucket offsets. Because the layout is derived, not saved, :func:`verify` then compares
the main weights read from the buckets with the model weights read from Megatron's model tensors: any other layout
(Transformer Engine's own parameter order, say) is a one-line error, never silently misplaced moments.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Optional

import torch

from .pieces import CheckpointError, Piece, SafeReader, read_objects

_BUCKET = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+"
                     r"\.bucket_idx_(\d+)\.param$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)$")
_ALIGN = 64  # Megatron's distributed optimizer starts each parameter at a multiple of 64 elements
FIX = ("re-save it from Megatron with --dist-ckpt-optim-fully-reshardable (any layout reads that), or resume with "
        "--no-load-optim")


# ----------------------------------------------------------------------------------------------
# What the checkpoint holds
# ----------------------------------------------------------------------------------------------

def buckets(saved: dict) -> dict:
    """{(chain prefix, group, gbuf): [(bucket tensor name without the state, unpadded size), ...] by bucket}."""
    out: dict = {}
    for key, (shape, _) in saved.items():
        m = _BUCKET.match(key)
        if m is not None:
            out.setdefault((m.group(1) or "", int(m.group(2)), int(m.group(3))), []).append(
                (int(m.group(4)), key[:-len(".param")], int(shape[0])))
    return {k: [(name, n) for _, name, n in sorted(v)] for k, v in out.items()}


def objects(d: Path) -> dict:
    """Megatron's non-tensor optimizer state saved as byte objects (each model-parallel group's param groups, step
    and loss scaler), read with torch's weights-only loader: {name: object}."""
    md = SafeReader(str(d)).read_metadata()
    found = read_objects(d, [k for k, v in md.state_dict_metadata.items()
                             if not hasattr(v, "size") and ".optimizer/shard_" in k])
    bad = [k for k, v in found.items() if v is None]
    if bad:
        raise CheckpointError(f"cannot read Megatron's optimizer state {bad[0]} in {d} (it names classes outside "
                              "plain values): resume with --no-load-optim")
    return found


# ----------------------------------------------------------------------------------------------
# Megatron's order of this rank's parameters
# ----------------------------------------------------------------------------------------------

@dataclass
class _Span:
    param: torch.nn.Parameter
    first: int  # the span's first element in the parameter (flattened, this rank's part)
    numel: int


_BLOCK = re.compile(r"^(.*?(?:decoder\.layers\.\d+\.|mtp\.layers\.\d+\.mtp_model_layer\.))(.*)$")


def _order_key(rest: str, te: bool) -> int:
    """A transformer layer's parameters (``rest``: the name inside the layer) in Megatron Core's registration order:
    the attention block registers its output projection before its QKV projection; under Transformer Engine's
    spec the input norm is the QKV projection's fused ``layer_norm_weight``, which TE registers before the weight.
    The MLP's norm comes before ``linear_fc1`` either way; everything else keeps paratron's order."""
    if rest.startswith("input_layernorm."):
        return 2 if te else 0
    if rest.startswith("self_attention.linear_proj."):
        return 1
    return 3 if rest.startswith("self_attention.") else 4


def _block(name: str) -> Optional[str]:
    m = _BLOCK.match(name)
    return None if m is None else m.group(1)


def _experts(name: str) -> Optional[str]:
    m = _EXPERTS.match(name)
    return None if m is None else m.group(1)


def megatron_params(named: list, grouped_experts: bool, te: bool = False) -> list[tuple[str, _Span]]:
    """(Megatron's name, span of a paratron parameter) in Megatron Core's ``named_parameters()`` order of a chunk
    whose paratron parameters are ``named`` [(global name, parameter)] in paratron's order; ``te``: the checkpoint
    was saved with Transformer Engine's layer spec (fused norms). A layer's parameters are ordered as a whole
    (:func:`_order_key`, a stable sort), then its stacked routed experts expanded (:func:`_expert_spans`)."""
    out = []
    for block, layer in groupby(named, key=lambda t: _block(t[0])):
        layer = list(layer) if block is None else sorted(layer, key=lambda t: _order_key(t[0][len(block):], te))
        for prefix, run in groupby(layer, key=lambda t: _experts(t[0])):
            run = list(run)
            out += ([(n, _Span(p, 0, p.numel())) for n, p in run] if prefix is None
                    else _expert_spans(run, prefix, grouped_experts))
    return out


def _expert_spans(run: list, prefix: str, grouped: bool) -> list[tuple[str, _Span]]:
    """The stacked experts [E, ...] of one layer as Megatron's per-expert parameters: SequentialMLP's
    ``local_experts.{e}.linear_fc1/2.weight`` expert by expert, or the grouped linear's ``linear_fc1.weight{e}``."""
    tensors = [(_EXPERTS.match(n), p) for n, p in run]
    experts = tensors[0][1].shape[0]
    per = [(m, p, p.numel() // experts) for m, p in tensors]
    if grouped:
        return [(f"{prefix}{m.group(2)}.{m.group(3)}{e}", _Span(p, e * n, n))
                for m, p, n in per for e in range(experts)]
    return [(f"{prefix}local_experts.{e}.{m.group(2)}.{m.group(3)}", _Span(p, e * n, n))
            for e in range(experts) for m, p, n in per]


def place(order: list[tuple[str, _Span]], sizes: list[tuple[str, int]]) -> list[tuple[_Span, str, int]]:
    """(span, bucket tensor name, offset there) of each parameter laid out as Megatron's buffer lays ``order``
    (reversed, each at a multiple of 64, a bucket ending where a parameter ends); ``sizes``: the saved buckets."""
    out, k, at = [], 0, 0
    for name, span in reversed(order):
        start = -(-at // _ALIGN) * _ALIGN
        if at and k < len(sizes) and start >= sizes[k][1]:  # (before the shared embedding: the aligned start)
            k, start = k + 1, 0
        if k >= len(sizes) or start + span.numel > sizes[k][1]:
            raise CheckpointError(f"Megatron's distributed optimizer state does not lay out as this model's "
                                  f"parameters (at {name}); {FIX}")
        out.append((span, sizes[k][0], start))
        at = start + span.numel
        if at == sizes[k][1]:
            k, at = k + 1, 0
    if k != len(sizes):
        raise CheckpointError(f"Megatron's distributed optimizer state holds more than this model's parameters; {FIX}")
    return out


# ----------------------------------------------------------------------------------------------
# This rank's optimizer shards as ranges of the buckets
# ----------------------------------------------------------------------------------------------

def check_layout(args: dict, dims, vpp: Optional[int]) -> None:
    """Megatron reads its dp_reshardable state only at the layout it saved; so does paratron (any DP size)."""
    theirs = {"--tensor-model-parallel-size": args.get("tensor_model_parallel_size") or 1,
              "--pipeline-model-parallel-size": args.get("pipeline_model_parallel_size") or 1,
              "--virtual-pipeline-model-parallel-size": args.get("virtual_pipeline_model_parallel_size") or 1,
              "--expert-model-parallel-size": args.get("expert_model_parallel_size") or 1,
              "--expert-tensor-parallel-size": args.get("expert_tensor_parallel_size")
              or args.get("tensor_model_parallel_size") or 1}
    ours = dict(zip(theirs, (dims.tp, dims.pp, vpp or 1, dims.ep, dims.etp)))
    diff = [f"{flag} {ours[flag]} here, {v} in the checkpoint" for flag, v in theirs.items() if ours[flag] != v]
    if diff:
        raise CheckpointError("Megatron's distributed optimizer state (dp_reshardable) is read only at the layout it "
                              f"was saved with: {'; '.join(diff)}; {FIX}")


def pieces(shards: list, chunks: list[list], saved: dict, dims, grouped_experts: bool, masters: bool,
           te: bool) -> tuple:
    """(pieces, checks) reading this rank's optimizer shards ``shards`` [(parameter, first element, master, {state:
    view})] from the buckets; ``chunks``: per model chunk, its [(global name, parameter)]. ``checks``: (parameter,
    first element, tensor the bucket's main weights are read into) for :func:`verify` (the master itself, or a
    scratch tensor when ``masters`` is False: the model is fp32 and its weights are the main weights). ``te``: saved
    with Transformer Engine's layer spec (Megatron's ``--transformer-impl``; its files name the norms alike)."""
    saved_buckets = buckets(saved)
    chained = any(chain for chain, _, _ in saved_buckets)
    where: dict = {}  # parameter -> [(span, bucket name, offset, bucket size)]
    for c, named in enumerate(chunks):
        for expert in (False, True):
            mine = [(n, p) for n, p in named if (_EXPERTS.match(n) is not None) == expert]
            if not mine:
                continue
            group = (dims.etp_rank + dims.etp * (dims.ep_rank + dims.ep * dims.pp_rank) if expert
                     else dims.tp_rank + dims.tp * dims.pp_rank)
            key = (f"chained_{int(expert)}." if chained else "", group, c)
            if key not in saved_buckets:
                raise CheckpointError(f"Megatron's distributed optimizer state has no buffer {key[0]}dp_group_idx_"
                                      f"{group}.gbuf_idx_{c} for this rank's {'expert' if expert else 'dense'} "
                                      f"parameters; {FIX}")
            size = dict(saved_buckets[key])
            for span, name, at in place(megatron_params(mine, grouped_experts, te), saved_buckets[key]):
                where.setdefault(span.param, []).append((span, name, at, size[name]))
    out, checks = [], []
    for p, lo, master, states in shards:
        scratch = master if masters else torch.empty_like(master)
        checks.append((p, lo, scratch))
        for state, view in {**states, "param": scratch}.items():
            flat = view.view(-1)
            for span, name, at, size in where[p]:
                a, b = max(lo, span.first), min(lo + flat.numel(), span.first + span.numel)
                if a < b:
                    out.append(Piece(f"{name}.{state}", (size,), (at + a - span.first,), flat[a - lo:b - lo]))
    return out, checks


def verify(checks: list, group, dtype: torch.dtype, into_weights: bool) -> None:
    """The main weights read from the buckets must be the model's weights read from Megatron's model tensors (both
    in ``dtype``, the checkpoint's model dtype): otherwise the derived layout is not Megatron's (checked on every
    rank). ``into_weights``: then copy the main weights into the (fp32) model, as fp32 weights come from fp32 mains."""
    from .sharded import _raise_if_any
    bad = sum(not torch.equal(main.reshape(-1).to(dtype), p.detach().reshape(-1)[lo:lo + main.numel()].to(dtype))
              for p, lo, main in checks)
    _raise_if_any(None if not bad else f"Megatron's distributed optimizer state (dp_reshardable) is not laid out as "
                  f"paratron derives it for this model ({bad} shards differ from the model weights); {FIX}", group)
    if into_weights:
        with torch.no_grad():
            for p, lo, main in checks:
                p.data.view(-1)[lo:lo + main.numel()].copy_(main.reshape(-1))
