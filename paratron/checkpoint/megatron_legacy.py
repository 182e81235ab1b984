"""Megatron-LM's legacy checkpoint format (``--ckpt-format torch``), merged into one TP=1 state.

checkpoint/megatron.py describes both formats: each ``mp_rank_*/model_optim_rng.pt`` holds one tensor / pipeline /
expert rank's slice, merged here over the tensor-parallel ranks (in Megatron Core's names) and numbered globally
over the pipeline stages and expert ranks."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from . import megatron_hybrid as hybrid
from .hf_config import ConversionError
from .megatron import _COLUMN, _LAYER, _RANK_DIR, LEGACY_FILE, _args, _torch_load


def _rank_dirs(d: Path, pipeline: bool) -> dict:
    """{(pp, ep): {tp: path}} of a legacy checkpoint's rank files. Megatron names them mp_rank_{tp:02d}, then
    _{pp:03d} when pipelined, then _{ep:03d} with expert parallelism: one suffix is the pipeline rank only when
    the run was pipelined (``pipeline``: its args' --pipeline-model-parallel-size > 1)."""
    found = defaultdict(dict)
    for p in sorted(d.iterdir()):
        m = _RANK_DIR.match(p.name)
        if m and (p / LEGACY_FILE).is_file():
            tp, a, b = (int(g) if g is not None else None for g in m.groups())
            pp, ep = (a or 0, b or 0) if pipeline else (0, a or 0)
            found[(pp, ep)][tp] = p / LEGACY_FILE
    return found


def read_legacy(d: Path) -> tuple[dict, dict]:
    """As :func:`_read_dist`, from the rank files, merged."""
    any_file = next(p / LEGACY_FILE for p in sorted(d.iterdir()) if _RANK_DIR.match(p.name) and
                    (p / LEGACY_FILE).is_file())
    first = _torch_load(any_file)
    args = hybrid.marked(_args(first.get("args")),
                         [k for name, chunk in first.items() if re.fullmatch(r"model\d*", name) for k in chunk])
    ranks = _rank_dirs(d, int(args.get("pipeline_model_parallel_size") or 1) > 1)
    if args.get("expert_tensor_parallel_size") not in (None, args.get("tensor_model_parallel_size", 1)):
        raise ConversionError("a legacy checkpoint with --expert-tensor-parallel-size unlike --tensor-model-parallel-"
                              "size: convert it to torch_dist with Megatron first (--ckpt-convert-format torch_dist)")
    if args.get("multi_latent_attention") and max(len(by_tp) for by_tp in ranks.values()) > 1:
        raise ConversionError("a legacy checkpoint of multi-latent attention saved with tensor parallelism: convert "
                              "it to torch_dist with Megatron first (--ckpt-convert-format torch_dist)")
    swiglu = bool(args.get("swiglu"))
    local, blocks = _local_experts(args), hybrid.mixer_blocks(args)
    chunks = {}  # (virtual stage, pp, ep) -> merged state of that chunk
    read = {any_file: first}  # (the file the args came from is not read again)
    for (pp, ep), by_tp in sorted(ranks.items()):
        files = [read.pop(by_tp[t], None) or _torch_load(by_tp[t]) for t in sorted(by_tp)]
        names = sorted(k for k in files[0] if re.fullmatch(r"model\d*", k))
        if not names:
            raise ConversionError(f"{by_tp[0]} holds no model state")
        for name in names:
            v = int(name[5:] or 0)
            chunks[(v, pp, ep)] = _merge_tp([f[name] for f in files], swiglu, local, blocks)
    return first, _number_globally(chunks, args)


def _merge_tp(shards: list, swiglu: bool, local_experts: int, blocks: dict) -> dict:
    """One chunk's TP slices -> whole tensors (``shards``: each TP rank's state, in TP order; ``blocks``: a hybrid
    model's Mamba block sizes, megatron_hybrid.mixer_blocks)."""
    out = {}
    for k, v in shards[0].items():
        if not isinstance(v, torch.Tensor) or "_extra_state" in k or k.endswith("mlp.experts.weight2"):
            continue
        parts = [s[k] for s in shards]
        mixer = hybrid.merge_mixer(k, parts, blocks)
        if mixer is not None:
            out[k] = mixer
        elif k.endswith("mlp.experts.weight1"):  # (with its weight2)
            out.update(_grouped_mlp(k[:-len("weight1")], parts, [s[k[:-1] + "2"] for s in shards], local_experts,
                                    swiglu))
        elif len(parts) == 1:
            out[k] = v
        elif re.search(r"linear_fc1\.(weight|bias)\d*$", k):
            if swiglu:  # each rank's [gate_r; up_r] -> [gate_0 .. gate_n; up_0 .. up_n]
                halves = [p.chunk(2, dim=0) for p in parts]
                out[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                out[k] = torch.cat(parts, dim=0)
        elif k.endswith(_COLUMN):
            out[k] = torch.cat(parts, dim=0)
        elif re.search(r"(linear_proj|linear_fc2)\.weight\d*$", k):
            out[k] = torch.cat(parts, dim=1)
        else:  # replicated (norms, router, row-parallel biases)
            out[k] = v
    return out


def _grouped_mlp(prefix: str, w1: list, w2: list, experts: int, swiglu: bool) -> dict:
    """Megatron's legacy GroupedMLP experts (``weight1`` [h, E 2f / TP] holding [E, h, 2f / TP], SwiGLU's halves along
    its last dimension; ``weight2`` [E f / TP, h] holding [E, f / TP, h]) -> each local expert's fc1 [2f, h] and
    fc2 [h, f], named as Transformer Engine's grouped linear names them (``linear_fc1.weight{e}``)."""
    h = w1[0].shape[0]
    per = [p.view(experts, h, -1) for p in w1]
    if swiglu:  # each rank's [gate_r | up_r] -> [gate_0 .. gate_n | up_0 .. up_n]
        halves = [p.chunk(2, dim=2) for p in per]
        fc1 = torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=2)
    else:
        fc1 = torch.cat(per, dim=2)
    fc2 = torch.cat([p.view(experts, -1, h) for p in w2], dim=1)
    out = {}
    for e in range(experts):
        out[f"{prefix}linear_fc1.weight{e}"] = fc1[e].t().contiguous()
        out[f"{prefix}linear_fc2.weight{e}"] = fc2[e].t().contiguous()
    return out


def _number_globally(chunks: dict, args: dict) -> dict:
    """Legacy chunks' layers (numbered from 0 in each chunk) and local experts (from 0 on each expert rank) ->
    global numbers: layers in the order of the virtual pipeline stages (chunk v of stage p holds stage v * PP + p),
    experts by expert rank."""
    out, offset = {}, 0
    eps = sorted({ep for (_, _, ep) in chunks})
    for v, pp in sorted({(v, pp) for (v, pp, _) in chunks}):
        count = 0
        for ep in eps:
            for k, t in chunks[(v, pp, ep)].items():
                m = _LAYER.match(k)
                if m is None:
                    out.setdefault(k, t)
                    continue
                count = max(count, int(m.group(2)) + 1)
                rest = _global_expert(m.group(3), ep, args)
                out[f"{m.group(1)}{int(m.group(2)) + offset}.{rest}"] = t
        offset += count
    return out


def _local_experts(args: dict) -> int:
    """Routed experts per expert-parallel rank (0 for a dense model)."""
    return int(args.get("num_experts") or 0) // max(int(args.get("expert_model_parallel_size") or 1), 1)


def _global_expert(rest: str, ep: int, args: dict) -> str:
    """A layer's key ``rest`` with expert rank ``ep``'s local expert number made global."""
    local = _local_experts(args)
    if rest.startswith("mlp.experts.local_experts."):
        i = int(rest.split(".")[3])
        return rest.replace(f"local_experts.{i}.", f"local_experts.{ep * local + i}.", 1)
    m = re.match(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$", rest)  # Transformer Engine's GroupedLinear
    if m:
        return f"{m.group(1)}{ep * local + int(m.group(2))}"
    return rest
