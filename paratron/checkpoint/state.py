"""What a training checkpoint holds, as :class:`~paratron.checkpoint.sharded.Piece` lists.

Tensor names do not depend on the parallel layout, so a checkpoint saved at one TP/PP/DP (with or
without the distributed optimizer) loads into any other:

    model.{name}                       the parameter (or persistent buffer) in the model's dtype; {name} is the one-stage
                                       model's name (global layer index; the last pipeline stage's
                                       copy of a tied embedding is embedding.word_embeddings.weight)
    optimizer.fp32_param.{name}        fp32 master weights (only when the model is bf16/fp16)
    optimizer.exp_avg.{name}           Adam moments, fp32 (bf16 with --exp-avg-dtype / --exp-avg-sq-dtype bf16;
                                       fp16 / fp8 moments are saved as their fp32 values: optim/moments.py)
    optimizer.exp_avg_sq.{name}
    optimizer.muon_momentum.{name}     Muon's momentum, fp32 (instead of the Adam moments of a Muon matrix)
    rng.{generator}                    [world size, n]: row r is rank r's generator state
    fp8.amax_history                   [world size, n]: row r is rank r's amax histories of the
                                       delayed FP8 recipe (restored only into the same layout)

The optimizer tensors of the plain optimizer are whole tensor-parallel shards; those of the
distributed optimizer (and the parameters under ZeRO-3) are flat ranges of them (its data-parallel shard), cut into rectangles of the
global tensor by :func:`~paratron.checkpoint.sharded.flat_pieces`. Scalars (iteration, consumed
samples, scheduler, loss scaler, Adam's step count, the layout and the config) go to common.json.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..optim.moments import checkpoint_view
from ..parallel.dims import ParallelDims
from ..parallel.sharding import coords_of, spec_of
from ..parallel.stages import global_name, unwrap
from ..parallel.zero import sharded_model_views
from .pieces import Piece, flat_pieces, replicated_row, tensor_pieces

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
FP8_HISTORY = "fp8.amax_history"


def param_keys(models: list) -> dict:
    """{parameter: layout-independent name} for this rank's model chunks (a pipeline copy of a tied
    parameter is named after the parameter it copies)."""
    out = {}
    for chunk in models:
        m = unwrap(chunk)
        for name, p in m.named_parameters():
            out[p] = spec_of(p).copy_of or global_name(name, m.decoder.layer_offset)
    return out


def sharded_state_dict(model) -> list[Piece]:
    """Megatron's ``GPTModel.sharded_state_dict()``: this rank's parameters of ``model`` as checkpoint
    pieces, chunks of the one-rank model's tensors with their offsets; ``paratron.checkpoint.sharded.save``
    / ``load`` write and read them in any parallel layout."""
    return model_pieces([model], model.dims)


def model_pieces(models: list, dims: ParallelDims, prefix: dict | None = None) -> list[Piece]:
    """Every parameter of this rank. ``prefix``: {name: checkpoint prefix} for names read from
    elsewhere than ``model.`` (fp32 params from the fp32 masters of a mixed-precision checkpoint)."""
    prefix = prefix or {}
    shards = sharded_model_views(models)  # ZeRO-3: a parameter is this rank's flat ranges of it
    out = []
    for p, key in param_keys(models).items():
        name, spec = prefix.get(key, "model.") + key, spec_of(p)
        if p in shards:
            out += [pc for lo, view in shards[p]
                    for pc in flat_pieces(name, view, tuple(p.shape), lo, spec, coords_of(spec, dims))]
        else:
            out += tensor_pieces(name, p.data, spec, coords_of(spec, dims))
    return out + buffer_pieces(models)


def buffer_pieces(models: list) -> list[Piece]:
    """The persistent buffers (an MoE router's expert bias), equal on every rank that holds them."""
    out = []
    for chunk in models:
        m = unwrap(chunk)
        params = {id(p) for p in m.parameters()}
        for name, t in m.state_dict(keep_vars=True).items():
            if id(t) not in params:
                out += tensor_pieces("model." + global_name(name, m.decoder.layer_offset), t.data)
    return out


def optimizer_shards(optimizer) -> list[tuple[torch.nn.Parameter, int, torch.Tensor]]:
    """(parameter, first flattened element, fp32 master) of each master tensor the optimizer steps."""
    if hasattr(optimizer, "pieces"):  # distributed: flat ranges of the gradient buffers
        return [(pc.param, pc.start, m) for pc, m in zip(optimizer.pieces, optimizer.masters)]
    return [(p, 0, m) for p, m in zip(optimizer.params, optimizer.masters)]


def ensure_adam_state(optimizer) -> None:
    """Create Adam's state (zero moments, step 0) where it does not exist yet, exactly as AdamW's
    first step would, so there is something to save and to load into."""
    adam = optimizer.adam
    for group in adam.param_groups:
        for m in group["params"]:
            if adam.state.get(m):
                continue
            on_device = group.get("fused") or group.get("capturable")
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            adam.state[m] = {"step": torch.zeros((), dtype=dtype, device=m.device if on_device else "cpu"),
                             "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                             "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}


def adam_step(optimizer) -> int:
    steps = [s["step"] for s in optimizer.adam.state.values() if "step" in s]
    return int(steps[0].item()) if steps else 0


def set_adam_step(optimizer, step: int) -> None:
    for s in optimizer.adam.state.values():
        s["step"].fill_(step)


def adam_shards(optimizer) -> list[tuple]:
    """(parameter, first flattened element, fp32 master, {Adam state: its fp32 view}) of each master tensor."""
    return [(p, lo, m, {s: checkpoint_view(optimizer.adam, m, s) for s in OPTIMIZER_STATES})
            for p, lo, m in optimizer_shards(optimizer)]


def optimizer_pieces(optimizer, models: list, dims: ParallelDims, masters_from: Optional[str] = None) -> list[Piece]:
    """Masters (when they are copies, i.e. mixed precision) and Adam moments of this rank.
    ``masters_from="model."`` reads the masters from the model weights (a checkpoint saved in fp32)."""
    keys = param_keys(models)
    muon = optimizer.muon
    momentum = {id(it.master): t for it, t in zip(muon.items, muon.momentum)} if muon is not None else {}
    out = []
    for p, lo, master in optimizer_shards(optimizer):
        key, spec = keys[p], spec_of(p)
        if id(master) in momentum:
            tensors = {"optimizer.muon_momentum.": momentum[id(master)]}
        else:
            tensors = {f"optimizer.{s}.": checkpoint_view(optimizer.adam, master, s) for s in OPTIMIZER_STATES}
        if optimizer.mixed:
            tensors[masters_from or "optimizer.fp32_param."] = master
        for prefix, t in tensors.items():
            out += flat_pieces(prefix + key, t.view(-1), tuple(p.shape), lo, spec, coords_of(spec, dims))
    return out


def rng_pieces(state: dict[str, torch.Tensor], dims: ParallelDims) -> list[Piece]:
    """This rank's generator states as row ``rank`` of ``rng.{generator}``."""
    return [replicated_row(f"rng.{name}", t, dims.rank, dims.world_size) for name, t in state.items()]


def layout(dims: ParallelDims, vpp: Optional[int]) -> dict:
    out = {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp,
           "vpp": vpp or 1}
    if dims.order != "tp-cp-ep-dp-pp":  # another rank order: the per-rank states belong to other coordinates
        out["order"] = dims.order
    return out
