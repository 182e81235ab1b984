"""Load a model for generation: a paratron checkpoint (any saved layout) or a Hugging Face directory,
into this process's tensor-parallel shard, with its tokenizer.

A paratron checkpoint is read piece by piece: each rank asks ``torch.distributed.checkpoint`` for
exactly its TP slices of the global tensors, whatever TP / PP / DP layout wrote them. A Hugging Face
directory is converted with the ``convert`` table (paratron/checkpoint/hf.py) and each rank keeps its
slices of the converted tensors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import sharded
from ..checkpoint.pieces import CheckpointError
from ..checkpoint.state import sharded_state_dict
from ..checkpoint.tokenizer_files import load_tokenizer
from ..model.bert import BertModel
from ..model.gpt import GPTModel
from ..parallel.dims import ParallelDims

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Loaded:
    model: GPTModel
    vocab_size: int  # the real vocabulary (the model's rows are padded)
    tokenizer: object  # paratron.data.tokenizers.Tokenizer, or None if none was found
    name: str  # what /v1/models calls it
    source: str  # "paratron checkpoint iteration N" / "Hugging Face <family>"


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / sharded.LATEST).exists() and \
        not any(path.glob("iter_*"))


def _model(m, padded_vocab: int, dims: ParallelDims, device, dtype, kernels=None) -> GPTModel:
    """``kernels``: the model's kernel switches (GPT models; None: every one auto)."""
    with torch.device(device):  # the random init is overwritten; build it where it will run
        if m.model == "t5":  # an encoder-decoder (paratron/inference/t5_generate.py generates with it)
            from ..model.t5 import T5Model
            model = T5Model(m, padded_vocab, dims, device=device, dtype=dtype)
        elif m.model == "bert":  # (--model bert: fill-mask only, inference/fill_mask.py)
            model = BertModel(m, padded_vocab, dims=dims, device=device, dtype=dtype)
        else:
            model = GPTModel(m, padded_vocab, dims=dims, kernels=kernels, device=device, dtype=dtype)
    model.par.rng = None  # no dropout in inference: no RNG forks (which a CUDA graph could not capture)
    return model.eval()


def _saved_dtype(d: Path) -> torch.dtype:
    shapes = sharded.tensor_shapes(d)
    key = "model.embedding.word_embeddings.weight"
    return shapes[key][1] if key in shapes else torch.float32


def load_paratron(root: Path, dims: ParallelDims, device, dtype: Optional[torch.dtype], iteration=None,
                  kernels=None) -> Loaded:
    from ..checkpoint.convert import _saved_config
    from ..checkpoint.hf_config import padded_vocab_size
    d = sharded.find_checkpoint(root, group=sharded.SOLO, warn=lambda m: None, iteration=iteration)
    if d is None:
        raise CheckpointError(f"--load {root}: no paratron checkpoint there (no {sharded.LATEST}, no iter_*), "
                              "and no config.json of a Hugging Face model")
    cfg = _saved_config(sharded.read_common(d), d)
    vocab = int(cfg.data.vocab_size or 0)
    if not vocab:
        raise CheckpointError(f"{d / sharded.COMMON} has no data.vocab_size: the real vocabulary size is unknown")
    _check_layout(cfg.model, dims)
    model = _model(cfg.model, padded_vocab_size(vocab, cfg.model, dims.tp), dims, device, dtype or _saved_dtype(d),
                   kernels)
    pieces, casts = sharded_state_dict(model), []
    saved = sharded.tensor_shapes(d)
    for p in pieces:  # the checkpoint's dtype may differ from the one asked for: read, then cast
        if p.key in saved and saved[p.key][1] != p.tensor.dtype:
            buf = torch.empty(p.tensor.shape, dtype=saved[p.key][1], device=p.tensor.device)
            casts.append((buf, p.tensor))
            p.tensor = buf
    sharded.load(d, pieces, group=sharded.SOLO)
    with torch.no_grad():
        for buf, target in casts:
            target.copy_(buf)
    tok = load_tokenizer(root, cfg.data)
    return Loaded(model, vocab, tok, root.resolve().name, f"paratron checkpoint {d.name}")


def load_hf(src: Path, dims: ParallelDims, device, dtype: Optional[torch.dtype], kernels=None) -> Loaded:
    from ..checkpoint.hf import hf_to_paratron, load_hf_dir
    from ..checkpoint.hf_bert import bert_config_from_hf, bert_hf_to_paratron
    from ..checkpoint.hf_config import model_config_from_hf, padded_vocab_size
    from ..checkpoint.hf_t5 import model_config_from_t5, t5_to_paratron
    d = json.loads((src / "config.json").read_text())
    bert, t5 = d.get("model_type") in ("bert", "megatron-bert"), d.get("model_type") == "t5"
    if t5:
        m, vocab, family = model_config_from_t5(d), int(d["vocab_size"]), "t5"
        m.model = "t5"
        m = m.resolved()
    else:
        m, vocab, family = bert_config_from_hf(d) if bert else model_config_from_hf(d)
    _check_layout(m, dims)
    hf_state, _ = load_hf_dir(src)
    padded = padded_vocab_size(vocab, m, dims.tp)
    if t5:
        state = t5_to_paratron(hf_state, m, padded)
    else:
        state = (bert_hf_to_paratron(hf_state, m, padded, family) if bert
                 else hf_to_paratron(hf_state, m, family, padded, vocab_size=vocab))
    family = "megatron-bert" if bert else family
    emb = state["embedding.word_embeddings.weight"]
    model = _model(m, padded, dims, device, dtype or emb.dtype, kernels)
    with torch.no_grad():
        for p in sharded_state_dict(model):
            full = state.get(p.key[len("model."):])
            if full is None:
                continue
            part = full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.tensor.shape))]
            p.tensor.copy_(part)
    return Loaded(model, vocab, load_tokenizer(src), src.resolve().name, f"Hugging Face {family}")


def _check_layout(m, dims: ParallelDims) -> None:
    """One line where the model cannot split over the launch: heads and widths over TP, the routed experts'
    width over expert-TP and their number over EP (--expert-model-parallel-size)."""
    tp, etp, ep = dims.tp, dims.size("etp"), dims.size("ep")
    checks = [(name, tp, "tensor-parallel") for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size",
                                                          "moe_shared_expert_intermediate_size")]
    for name, ranks, what in checks + [("moe_ffn_hidden_size", etp, "expert-tensor-parallel"),
                                       ("num_experts", ep, "expert-parallel")]:
        size = getattr(m, name)
        if size is not None and size % ranks:
            raise CheckpointError(f"{name} {size} is not divisible by the {ranks} {what} ranks; "
                                  f"run with a world size (or --expert-model-parallel-size) that divides it")
    if ep > 1 and not m.num_experts:
        raise CheckpointError(f"--expert-model-parallel-size {ep}: the model has no experts to split")


def is_t5(path) -> bool:
    """Whether ``path`` holds a T5 (a paratron checkpoint of --model t5, or a Hugging Face T5 directory)."""
    from ..checkpoint.convert import _saved_config
    root = Path(path)
    if not root.is_dir():
        return False
    if is_hf_dir(root):
        return json.loads((root / "config.json").read_text()).get("model_type") == "t5"
    d = sharded.find_checkpoint(root, group=sharded.SOLO, warn=lambda m: None)
    return d is not None and _saved_config(sharded.read_common(d), d).model.model == "t5"


def load_for_inference(path, dims: Optional[ParallelDims] = None, device="cpu", dtype: Optional[str] = None,
                       iteration: Optional[int] = None, kernels=None) -> Loaded:
    """The model at ``path`` in this rank's TP shard (``dims``: TP over all ranks), its tokenizer; ``kernels``: the
    model's kernel switches (``paratron generate`` / ``serve``'s --kernel-decode-*; None: auto)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"--load {root}: " + ("not a directory" if root.exists() else "does not exist"))
    dims = dims or ParallelDims()
    torch_dtype = DTYPES[dtype] if dtype else None
    if is_hf_dir(root):
        return load_hf(root, dims, device, torch_dtype, kernels)
    return load_paratron(root, dims, device, torch_dtype, iteration, kernels)
