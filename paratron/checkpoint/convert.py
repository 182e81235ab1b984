"""``paratron convert``: paratron checkpoints <-> Hugging Face model directories.

    paratron convert --to hf --load CKPT_DIR --output HF_DIR [--family F] [--iteration N] [--dtype D] [--force]
    paratron convert --from hf --input HF_DIR --save CKPT_DIR [--tensor-model-parallel-size N] [--dtype D] [--force]

``--to hf`` reads one iteration of a paratron checkpoint (``{root}/iter_{N:07d}/rank_{r:05d}.pt`` plus
``metadata.json``, see paratron/checkpoint/local.py) saved with any tensor / pipeline / data / context
parallel layout, rebuilds the whole model's (TP=1, one stage) state dict and writes it with
:func:`paratron.checkpoint.hf.save_hf_dir`. ``--from hf`` writes a paratron checkpoint at iteration 0
(model weights only) that ``pretrain_gpt.py ... --load CKPT_DIR --finetune`` trains from, and prints
the model flags to train it with.

Rank files hold plain tensors, so how a tensor is split over the tensor-parallel ranks is read from
its name (:data:`TP_SPLIT`, the same splits as paratron/parallel/tensor.py's layers):

    parameter name                                              split dim  layer
    embedding.word_embeddings.weight                            0          VocabParallelEmbedding
    output_layer.weight                                         0          ColumnParallelLinear
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}  0          ColumnParallelLinear
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}             0          ColumnParallelLinear, 2 blocks with SwiGLU
    decoder.layers.{i}.self_attention.linear_proj.weight        1          RowParallelLinear
    decoder.layers.{i}.mlp.linear_fc2.weight                    1          RowParallelLinear
    embedding.position_embeddings.weight, every norm's          -          replicated (TP rank 0's copy is used)
      weight/bias, linear_proj.bias, linear_fc2.bias

With SwiGLU each rank's ``linear_fc1`` is ``[gate_r; up_r]``, so the full ``[gate; up]`` is the
ranks' gate halves, then their up halves. ``linear_qkv`` rows are laid out by query group, so a
plain concatenation restores them. A name that matches no row is an error, never a guess.

Pipeline stages: the rank files of pipeline rank ``r`` hold the model chunk(s) of that stage with
layers numbered from 0 (``model``, or ``model0``, ``model1``, ... with virtual stages); the global
layer index is the chunk's first layer (paratron/parallel/stages.py: ``chunk_layers``) plus the
local index. Data-parallel and context-parallel replicas hold the same weights: only those with
dp_rank = cp_rank = 0 are read.

Errors are one line on stderr and exit code 2. Nothing existing is overwritten unless ``--force``
is given, and the output is written under a temporary name and moved into place when complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from . import local
from .hf import FAMILIES, ConversionError
from .local import LATEST

__all__ = ["main", "TP_SPLIT", "tp_split", "merge_tp", "shard_tp", "read_checkpoint", "default_family",
           "training_flags", "to_hf", "from_hf"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_HF_CKPT_FILES = re.compile(r"^(config\.json|model.*\.safetensors(\.index\.json)?"
                            r"|pytorch_model.*\.bin(\.index\.json)?)$")
_PARATRON_CKPT_FILES = re.compile(r"^(latest_checkpointed_iteration\.txt|iter_\d{7}|\.iter_\d{7}\.partial)$")

_L = r"decoder\.layers\.\d+\."
# (name pattern, split dim, blocks): blocks "swiglu" = 2 when the model uses SwiGLU, else 1.
TP_SPLIT: list[tuple[re.Pattern, Optional[int], object]] = [
    (re.compile(r"embedding\.word_embeddings\.weight"), 0, 1),
    (re.compile(r"output_layer\.weight"), 0, 1),
    (re.compile(_L + r"self_attention\.linear_qkv\.(weight|bias)"), 0, 1),
    (re.compile(_L + r"mlp\.linear_fc1\.(weight|bias)"), 0, "swiglu"),
    (re.compile(_L + r"self_attention\.linear_proj\.weight"), 1, 1),
    (re.compile(_L + r"mlp\.linear_fc2\.weight"), 1, 1),
    (re.compile(r"embedding\.position_embeddings\.weight"), None, 1),
    (re.compile(_L + r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias"), None, 1),
    (re.compile(r"(" + _L + r"(input_layernorm|pre_mlp_layernorm|self_attention\.[qk]_layernorm)"
                r"|decoder\.final_layernorm)\.(weight|bias)"), None, 1),
]


class _Log:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"convert: {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Tensor-parallel splits
# ----------------------------------------------------------------------------------------------

def tp_split(name: str, swiglu: bool) -> Optional[tuple[int, int]]:
    """(split dim, blocks) of a parameter over tensor-parallel ranks, or None when replicated."""
    for pattern, dim, blocks in TP_SPLIT:
        if pattern.fullmatch(name):
            if dim is None:
                return None
            return dim, (2 if swiglu else 1) if blocks == "swiglu" else blocks
    raise ConversionError(f"unknown tensor {name!r}: paratron convert does not know how it is split over "
                          "tensor-parallel ranks")


def merge_tp(shards: list, dim: int, blocks: int = 1):
    """The full tensor from the tensor-parallel ranks' shards (each is ``blocks`` equal blocks along
    ``dim``, block ``c`` of rank ``r`` being slice ``r`` of the full block ``c``)."""
    if len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(blocks, dim=dim) for s in shards]
    return torch.cat([per_rank[r][c] for c in range(blocks) for r in range(len(shards))], dim=dim)


def shard_tp(full, dim: int, blocks: int, n: int, r: int):
    """Rank ``r``'s shard of ``full`` over ``n`` tensor-parallel ranks (inverse of :func:`merge_tp`)."""
    if n == 1:
        return full
    if full.shape[dim] % (n * blocks):
        raise ConversionError(f"a tensor of shape {tuple(full.shape)} does not split into {blocks} x {n} parts "
                              f"along dimension {dim}")
    return torch.cat([b.chunk(n, dim=dim)[r] for b in full.chunk(blocks, dim=dim)], dim=dim).contiguous()


# ----------------------------------------------------------------------------------------------
# Reading a paratron checkpoint
# ----------------------------------------------------------------------------------------------

def _saved_config(meta: dict, where: Path):
    """The run's Config from metadata.json (sections of Config.to_dict())."""
    from ..config import SECTIONS, Config
    raw = meta.get("config")
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ConversionError(f"{where} has no model configuration (metadata.json 'config')")
    cfg = Config()
    for sec, cls in SECTIONS.items():
        values = raw.get(sec) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k, v in values.items() if k not in known and v not in (None, False))
        if sec == "model" and unknown:
            raise ConversionError(f"{where} uses model setting(s) this paratron does not have: {', '.join(unknown)}")
        setattr(cfg, sec, cls(**{k: v for k, v in values.items() if k in known}))
    cfg.model.fill_defaults()
    return cfg


def _available_iterations(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.is_dir() and re.fullmatch(r"iter_\d{7}", p.name))


def _resolve_iteration(root: Path, iteration: Optional[int]) -> int:
    if iteration is not None:
        if not (root / f"iter_{iteration:07d}").is_dir():
            have = _available_iterations(root)
            raise ConversionError(f"{root} has no iteration {iteration} (it has "
                                  f"{', '.join(map(str, have)) if have else 'none'})")
        return iteration
    try:
        latest = local.latest_iteration(root)
    except local.CheckpointError as e:
        raise ConversionError(str(e)) from None
    if latest is None:
        have = _available_iterations(root)
        hint = f"; pass --iteration ({', '.join(map(str, have))})" if have else ""
        raise ConversionError(f"no paratron checkpoint in {root}: it has no {LATEST}{hint}")
    return latest


def _load_rank_file(path: Path) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path} is missing")
    try:
        try:  # mmap: only the model's tensors are read, not the optimizer state next to them
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or corrupted
        raise ConversionError(f"{path} is corrupted or truncated ({e.__class__.__name__})") from None


def _stage_layout(cfg, pp: int, vpp: int) -> dict:
    """{(virtual index, pipeline rank): (first global layer, number of layers)}."""
    if pp == 1 and vpp == 1:
        return {(0, 0): (0, cfg.model.num_layers)}
    from ..parallel.stages import chunk_layers
    par = cfg.parallel
    try:
        return chunk_layers(cfg.model.num_layers, pp, vpp if vpp > 1 else None, par.decoder_first_pipeline_num_layers,
                            par.decoder_last_pipeline_num_layers)
    except ValueError as e:  # ConfigError
        raise ConversionError(f"the checkpoint's pipeline layout is inconsistent: {e}") from None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def read_checkpoint(root, iteration: Optional[int] = None, log=None) -> tuple:
    """(Config, real vocabulary size, iteration, full state dict) of a paratron checkpoint: the
    TP=1, one-stage ``GPTModel`` state dict rebuilt from the rank files of any layout."""
    log = log or _Log(True)
    root = Path(root)
    it = _resolve_iteration(root, iteration)
    d = root / f"iter_{it:07d}"
    try:
        meta = json.loads((d / "metadata.json").read_text())
    except FileNotFoundError:
        raise ConversionError(f"{d} has no metadata.json; not a complete paratron checkpoint") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {d / 'metadata.json'}: {e.__class__.__name__}") from None
    cfg = _saved_config(meta, d)
    vocab = cfg.data.vocab_size
    if not vocab:
        raise ConversionError(f"{d / 'metadata.json'} has no data.vocab_size: the real vocabulary size is unknown")
    lay = meta.get("layout") or {}
    tp, pp, dp, cp = (int(lay.get(k, 1) or 1) for k in ("tp", "pp", "dp", "cp"))
    world = int(meta.get("world_size", tp * pp * dp * cp))
    if world != tp * pp * dp * cp:
        raise ConversionError(f"{d / 'metadata.json'}: world_size {world} is not TP {tp} x PP {pp} x DP {dp} x CP {cp}")
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    layout = _stage_layout(cfg, pp, vpp)
    log(f"reading {d} (iteration {it}; saved by {world} rank(s): TP {tp} x PP {pp} x DP {dp} x CP {cp}"
        + (f", {vpp} virtual stages" if vpp > 1 else "") + ")")

    swiglu = cfg.model.swiglu
    full: dict = {}
    differ = []
    for r in range(pp):
        # Megatron's rank order tp-cp-dp-pp: dp_rank = cp_rank = 0 of pipeline rank r.
        files = [_load_rank_file(d / f"rank_{t + r * tp * cp * dp:05d}.pt") for t in range(tp)]
        for v in range(vpp):
            key = "model" if vpp == 1 else f"model{v}"
            states = []
            for t, f in enumerate(files):
                if not isinstance(f.get(key), dict):
                    raise ConversionError(f"{d / f'rank_{t + r * tp * cp * dp:05d}.pt'} has no {key!r} state dict")
                states.append(f[key])
            names = list(states[0])
            for t, s in enumerate(states[1:], 1):
                if set(s) != set(names):
                    raise ConversionError(f"TP ranks 0 and {t} of pipeline stage {r} hold different tensors")
            offset, count = layout[(v, r)]
            local_layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
            if local_layers != set(range(count)):
                raise ConversionError(f"pipeline rank {r}, chunk {v} holds layers {sorted(local_layers)}; the saved "
                                      f"layout gives it {count} layer(s) from layer {offset}")
            for name in names:
                split = tp_split(name, swiglu)
                shards = [s[name] for s in states]
                if split is None:
                    t0 = shards[0]
                    if any(not torch.equal(t0, s) for s in shards[1:]):
                        differ.append(name)
                    tensor = t0
                else:
                    tensor = merge_tp(shards, *split)
                gname = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
                if gname in full:
                    if gname == "output_layer.weight":  # tied copy on the last stage; the embedding is kept
                        continue
                    raise ConversionError(f"{gname} is held by two pipeline stages")
                full[gname] = tensor
    if not cfg.model.untie_embeddings_and_output_weights:
        full.pop("output_layer.weight", None)  # the last stage's copy of a tied embedding
    if differ:
        log(f"warning: {len(differ)} replicated tensor(s) differ between TP ranks (e.g. {differ[0]}); "
            "TP rank 0's are used")
    log(f"merged {len(full)} tensors from {tp * pp} rank file(s)")
    return cfg, int(vocab), it, full


# ----------------------------------------------------------------------------------------------
# Families and training flags
# ----------------------------------------------------------------------------------------------

def default_family(m) -> str:
    """The Hugging Face family of a paratron model: LayerNorm + GeLU -> gpt2; RMSNorm + SwiGLU -> llama,
    or qwen2 with q/k/v-only biases, qwen3 with --qk-layernorm. Mistral is never chosen (a Llama
    without biases is both): pass --family mistral."""
    if m.normalization == "LayerNorm" and not m.swiglu:
        return "gpt2"
    if m.qk_layernorm:
        return "qwen3"
    if m.disable_bias_linear and m.add_qkv_bias:
        return "qwen2"
    return "llama"


# Always printed (the model's shape); other model settings only where they differ from the default.
_ALWAYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
           "max_position_embeddings", "position_embedding_type", "normalization", "norm_epsilon",
           "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by")


def training_flags(m, tensor_model_parallel_size: int = 1) -> list[str]:
    """Megatron flags that build exactly the model ``m`` (a ModelConfig)."""
    from ..config import ModelConfig, flag
    out = []
    for f in dataclasses.fields(ModelConfig):
        v, name = getattr(m, f.name), f.name
        if v is None:
            continue
        if name == "num_query_groups" and not m.group_query_attention:
            continue
        if name in ("rotary_base", "rotary_percent") and m.position_embedding_type != "rope":
            continue
        if name == "rope_scaling_factor" and not m.use_rope_scaling:
            continue
        if isinstance(v, bool):
            if v:
                out.append(flag(name))
        elif name in _ALWAYS or name == "num_query_groups" or v != f.default:
            out += [flag(name), str(v)]
    if tensor_model_parallel_size > 1:
        out += ["--tensor-model-parallel-size", str(tensor_model_parallel_size)]
    return out


# ----------------------------------------------------------------------------------------------
# Writing: a temporary directory, moved into place when complete
# ----------------------------------------------------------------------------------------------

def _staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.convert-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _existing(out: Path, pattern: re.Pattern) -> list[str]:
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if pattern.match(p.name))


def _publish(tmp: Path, out: Path, old: list[str], last: Optional[str] = None) -> None:
    """Move the staged entries of ``tmp`` into ``out``. ``old``: the checkpoint entries of ``out`` to
    replace (moved away only once the new ones are in place, except those with a new entry's name);
    ``last``: the staged entry to move last (the latest-iteration marker)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = tmp / ".replaced"
    trash.mkdir()
    new = sorted((p.name for p in tmp.iterdir() if p.name != ".replaced"), key=lambda n: n == last)
    for name in new:
        if (out / name).is_dir():
            os.replace(out / name, trash / name)
        os.replace(tmp / name, out / name)  # files are replaced atomically
    for name in old:
        if name not in new and (out / name).exists():
            os.replace(out / name, trash / name)
    shutil.rmtree(tmp)


def _check_output(out: Path, pattern: re.Pattern, force: bool, what: str, flag: str) -> list[str]:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{flag} {out} exists and is not a directory")
    old = _existing(out, pattern)
    if old and not force:
        raise ConversionError(f"{out} already holds {what} ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}); "
                              f"pass --force to replace it, or choose another {flag}")
    return old


# ----------------------------------------------------------------------------------------------
# The two directions
# ----------------------------------------------------------------------------------------------

def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else getattr(torch, _DTYPES[name])


def to_hf(load, output, family: Optional[str] = None, iteration: Optional[int] = None, dtype: Optional[str] = None,
          force: bool = False, log=None) -> Path:
    """paratron checkpoint ``load`` -> Hugging Face directory ``output``."""
    from .hf import save_hf_dir
    log = log or _Log(True)
    load, output = Path(load), Path(output)
    if not load.is_dir():
        raise ConversionError(f"--load {load} is not a directory" if load.exists() else f"--load {load} does not exist")
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"unknown family {family!r}; paratron converts {', '.join(FAMILIES)}")
    old = _check_output(output, _HF_CKPT_FILES, force, "a Hugging Face checkpoint", "--output")
    cfg, vocab, it, state = read_checkpoint(load, iteration, log)
    fam = family or default_family(cfg.model)
    n = sum(t.numel() for t in state.values())
    rows = state["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in state else "?"
    log(f"writing Hugging Face {fam} ({'given' if family else 'from the model config'}), vocabulary {vocab} "
        f"(padded {rows} in paratron), dtype {dtype or 'as saved'}, to {output}")
    tmp = _staging_dir(output)
    try:
        extra = {"paratron": {"checkpoint": str(load.resolve()), "iteration": it}}
        save_hf_dir(tmp, state, cfg.model, fam, vocab, dtype=_dtype(dtype), extra_config=extra)
        _publish(tmp, output, old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"done: {output} ({n / 1e6:.2f}M parameters from iteration {it}); "
        f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(output)!r})")
    return output


def from_hf(input, save, tensor_model_parallel_size: int = 1, dtype: Optional[str] = None, force: bool = False,
            log=None) -> list[str]:
    """Hugging Face directory ``input`` -> paratron checkpoint ``save`` (iteration 0, model weights
    only, ``tensor_model_parallel_size`` rank files); returns the model flags to train it with."""
    from ..config import Config
    from .hf import hf_to_paratron, load_hf_dir, model_config_from_hf, padded_vocab_size
    log = log or _Log(True)
    src, save = Path(input), Path(save)
    tp = int(tensor_model_parallel_size)
    if not src.is_dir():
        raise ConversionError(f"--input {src} is not a directory" if src.exists() else f"--input {src} does not exist")
    if not (src / "config.json").is_file():
        raise ConversionError(f"--input {src} has no config.json; pass a Hugging Face model directory")
    if tp < 1:
        raise ConversionError(f"--tensor-model-parallel-size must be >= 1 (got {tp})")
    old = _check_output(save, _PARATRON_CKPT_FILES, force, "a paratron checkpoint", "--save")
    try:
        hf_config = json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{src / 'config.json'} is not valid JSON (line {e.lineno})") from None
    m, vocab, family = model_config_from_hf(hf_config)
    log(f"reading {src} ({family}: {m.num_layers} layers, hidden {m.hidden_size}, vocabulary {vocab})")
    for name, size in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups),
                       ("ffn_hidden_size", m.ffn_hidden_size)):
        if size % tp:
            raise ConversionError(f"{name} {size} is not divisible by --tensor-model-parallel-size {tp}")
    try:
        hf_state, _ = load_hf_dir(src)
    except ConversionError:
        raise
    except Exception as e:
        raise ConversionError(f"cannot read the weights in {src}: {e.__class__.__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
    padded = padded_vocab_size(vocab, m, tp)
    state = hf_to_paratron(hf_state, m, family, padded)
    if dtype is not None:
        state = {k: (v.to(_dtype(dtype)) if v.is_floating_point() else v) for k, v in state.items()}
    log(f"converted {len(state)} tensors ({sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters), "
        f"vocabulary padded {vocab} -> {padded}")

    cfg = Config()
    cfg.model = m
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.data.vocab_size = vocab
    meta = {"config": cfg.to_dict(), "consumed_samples": 0, "skipped_iterations": 0, "iteration": 0,
            "world_size": tp, "layout": {"tp": tp, "pp": 1, "dp": 1, "cp": 1},
            "converted_from": {"hf": str(src.resolve()), "family": family}}
    log(f"writing a paratron checkpoint (iteration 0, TP {tp}, {tp} rank file(s)) to {save}")
    tmp = _staging_dir(save)
    try:
        d = tmp / "iter_0000000"
        d.mkdir()
        for r in range(tp):
            shard = {}
            for name, t in state.items():
                split = tp_split(name, m.swiglu)
                shard[name] = t.contiguous() if split is None else shard_tp(t, *split, tp, r)
            torch.save({"model": shard, "iteration": 0, "consumed_samples": 0}, d / f"rank_{r:05d}.pt")
        (d / "metadata.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        (tmp / LATEST).write_text("0")
        _publish(tmp, save, old, last=LATEST)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    flags = training_flags(m, tp)
    launcher = "pretrain_gpt.py" if tp == 1 else f"torchrun --nproc-per-node {tp} pretrain_gpt.py"
    log("done. Train from it with (add your data, tokenizer and training flags):")
    print(f"  {launcher} {' '.join(flags)} --load {shlex.quote(str(save))} --finetune", flush=True)
    tok = (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {shlex.quote(str(src))}"
           if (src / "tokenizer.json").is_file() else "a tokenizer")
    log(f"the vocabulary must pad to the same {padded} rows: use {tok} with {vocab} tokens "
        f"(any size in ({padded - tp * m.make_vocab_size_divisible_by}, {padded}] works); run {tp} process(es)")
    return flags


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConversionError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="paratron convert", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Convert paratron checkpoints to and from Hugging Face model directories.\n\n"
                "  paratron convert --to hf --load CKPT_DIR --output HF_DIR [--family F] [--iteration N]\n"
                "  paratron convert --from hf --input HF_DIR --save CKPT_DIR [--tensor-model-parallel-size N]")
    p.add_argument("--to", dest="to", metavar="hf", help="convert a paratron checkpoint to Hugging Face")
    p.add_argument("--from", dest="frm", metavar="hf", help="convert a Hugging Face model to a paratron checkpoint")
    p.add_argument("--load", metavar="CKPT_DIR", help="--to hf: the paratron checkpoint (training's --save directory)")
    p.add_argument("--output", metavar="HF_DIR", help="--to hf: the Hugging Face directory to write")
    p.add_argument("--family", metavar="F", help=f"--to hf: {'|'.join(FAMILIES)} (default: from the model config)")
    p.add_argument("--iteration", metavar="N", type=int, help="--to hf: this iteration instead of the latest")
    p.add_argument("--input", metavar="HF_DIR", help="--from hf: the Hugging Face model directory")
    p.add_argument("--save", metavar="CKPT_DIR", help="--from hf: the paratron checkpoint directory to write")
    p.add_argument("--tensor-model-parallel-size", metavar="N", type=int, default=1,
                   help="--from hf: write N rank files for a TP=N run (default 1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="cast the weights (default: keep their dtype)")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _run(argv: list[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    log = _Log(a.quiet)
    if (a.to is None) == (a.frm is None):
        raise ConversionError("pass exactly one of --to hf or --from hf (see `paratron convert --help`)")
    fmt = a.to if a.to is not None else a.frm
    if fmt.lower() not in ("hf", "huggingface"):
        raise ConversionError(f"unknown format {fmt!r}: paratron converts to and from hf (Hugging Face)")

    def forbid(*names):
        given = [n for n in names if getattr(a, n.lstrip("-").replace("-", "_")) not in (None, False, 1)]
        if given:
            raise ConversionError(f"{given[0]} does not apply to --{'to' if a.to else 'from'} hf")

    if a.to is not None:
        forbid("--input", "--save", "--tensor-model-parallel-size")
        if not a.load or not a.output:
            raise ConversionError("--to hf needs --load CKPT_DIR and --output HF_DIR")
        to_hf(a.load, a.output, a.family, a.iteration, a.dtype, a.force, log)
    else:
        forbid("--load", "--output", "--family", "--iteration")
        if not a.input or not a.save:
            raise ConversionError("--from hf needs --input HF_DIR and --save CKPT_DIR")
        from_hf(a.input, a.save, a.tensor_model_parallel_size, a.dtype, a.force, log)
    return 0


def _user_errors() -> tuple:
    from ..config import ConfigError
    return ConversionError, ConfigError, local.CheckpointError


def main(argv: Optional[list[str]] = None) -> int:
    """``paratron convert ...``: 0 on success; 2 with one line on stderr for a user error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _user_errors() as e:
        msg = str(e)
    except OSError as e:
        msg = f"{e.strerror or e.__class__.__name__}: {e.filename}" if e.filename else str(e)
    print(f"paratron convert: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2
