"""``paratron convert``: paratron checkpoints <-> Hugging Face model directories; Megatron-LM checkpoints ->
paratron checkpoints (paratron/checkpoint/megatron.py reads them).

    paratron convert --to hf --load CKPT_DIR --output HF_DIR [--family F] [--iteration N] [--dtype D] [--force]
    paratron convert --from hf --input HF_DIR --save CKPT_DIR [--tensor-model-parallel-size N] [--dtype D] [--force]
    paratron convert --from megatron --input MEGATRON_DIR --save CKPT_DIR [--iteration N] [--dtype D] [--force]

Checkpoints are the sharded ``torch.distributed.checkpoint`` directories training writes
(paratron/checkpoint/sharded.py and state.py): ``{root}/iter_{N:07d}/`` holds DCP's ``.metadata``
index, the ``__{rank}_{n}.distcp`` chunk files, ``common.json`` (iteration, consumed samples, layout,
the whole ``Config.to_dict()``, ...) and ``metadata.json`` (size and CRC-32 of every file), and
``{root}/latest_checkpointed_iteration.txt`` names the newest complete iteration. Every tensor is
stored as a *global* tensor, the shape it has in the one-rank, one-stage, TP=1 model, under a name
that does not depend on the layout: ``model.{name}`` is parameter ``{name}`` of that model (global
layer index; a tied output layer is only ``model.embedding.word_embeddings.weight``) in the model's
dtype. The ``optimizer.*`` and ``rng.*`` tensors are not converted.

``--to hf`` verifies one iteration (the latest complete one by default, falling back from a damaged
latest with a warning; ``--iteration N`` exactly that one), reads its ``model.*`` tensors in this one
process whatever TP / PP / DP / CP layout saved them, rebuilds the model config from ``common.json``
and writes a Hugging Face directory with :func:`paratron.checkpoint.hf.save_hf_dir`. ``--from hf``
writes iteration 0 holding the model weights only (no optimizer, RNG or scheduler state) as a
one-rank checkpoint; loading reshards, so ``pretrain_gpt.py ... --load CKPT_DIR [--finetune]`` trains
from it in any layout. It prints the model flags to train it with.

Errors are one line on stderr and exit code 2. Nothing existing is overwritten unless ``--force``
is given, and the output is written under a temporary name and moved into place when complete.
"""
from __future__ import annotations

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

from ..config import SECTIONS, Config, DataConfig, ModelConfig, flag
from . import sharded
from .megatron import from_megatron  # noqa: F401 (paratron convert --from megatron)
from .convert_flags import DTYPES, build_parser
from .hf_config import FAMILIES, ConversionError

__all__ = ["main", "read_checkpoint", "default_family", "training_flags", "to_hf", "from_hf", "from_megatron"]

_HF_CKPT_FILES = re.compile(r"^(config\.json|model.*\.safetensors(\.index\.json)?"
                            r"|pytorch_model.*\.bin(\.index\.json)?)$")
_PARATRON_CKPT_FILES = re.compile(r"^(latest_checkpointed_iteration\.txt|iter_\d{7}|\.iter_\d{7}\.(partial|old))$")


class _Log:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"convert: {msg}", flush=True)


def _warn(msg: str) -> None:  # not silenced by --quiet: it says which iteration is converted
    print(f"convert: {msg.strip()}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Reading a paratron checkpoint
# ----------------------------------------------------------------------------------------------

def _saved_config(common: dict, where: Path):
    """The run's Config from common.json (sections of Config.to_dict()), its model section resolved
    (the run's other sections are as saved: their files need not exist here)."""
    raw = common.get("config")
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ConversionError(f"{where} has no model configuration (common.json 'config')")
    sections = {}
    for sec, cls in SECTIONS.items():
        values = raw.get(sec) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k, v in values.items() if k not in known and v not in (None, False))
        if sec == "model" and unknown:
            raise ConversionError(f"{where} uses model setting(s) this paratron does not have: {', '.join(unknown)}")
        sections[sec] = cls(**{k: v for k, v in values.items() if k in known})
    sections["model"] = sections["model"].resolved()
    return Config(**sections)


def read_checkpoint(root, iteration: Optional[int] = None, log=None) -> tuple:
    """(Config, real vocabulary size, iteration, state dict) of a paratron checkpoint: the TP=1,
    one-stage ``GPTModel`` state dict, read from the ``model.*`` tensors of any layout."""
    log = log or _Log(True)
    root = Path(root)
    d = sharded.find_checkpoint(root, group=sharded.SOLO, warn=_warn, iteration=iteration)
    if d is None:
        raise ConversionError(f"no paratron checkpoint in {root}: it has no {sharded.LATEST} and no iter_* directory")
    common = sharded.read_common(d)
    cfg = _saved_config(common, d)
    if not cfg.data.vocab_size:
        raise ConversionError(f"{d / sharded.COMMON} has no data.vocab_size: the real vocabulary size is unknown")
    keys = [k for k in sharded.tensor_shapes(d) if k.startswith("model.")]
    if not keys:
        raise ConversionError(f"{d} holds no model weights (model.* tensors)")
    lay, it = common.get("layout") or {}, int(d.name[5:])
    log(f"reading {d} (iteration {it}; saved by {lay.get('world_size', '?')} rank(s): TP {lay.get('tp', '?')} x "
        f"PP {lay.get('pp', '?')} x DP {lay.get('dp', '?')} x CP {lay.get('cp', '?')})")
    state = {k[len("model."):]: t for k, t in sharded.load_full(d, keys).items()}
    return cfg, int(cfg.data.vocab_size), it, state


# ----------------------------------------------------------------------------------------------
# Families and training flags
# ----------------------------------------------------------------------------------------------

def default_family(m) -> str:
    """The Hugging Face family of a paratron model: LayerNorm + GeLU -> gpt2; RMSNorm + SwiGLU -> llama,
    or qwen2 with q/k/v-only biases, qwen3 with --qk-layernorm; with --num-experts, qwen3_moe with
    --qk-layernorm, else mixtral; with --multi-latent-attention, deepseek_v3. Mistral is never chosen (a Llama
    without biases is both): pass --family mistral. A hybrid stack: mamba2 when every layer is Mamba-2, else
    nemotron_h; Gated DeltaNet mixers (--experimental-attention-variant): qwen3_next."""
    if m.multi_latent_attention:
        return "deepseek_v3"
    if m.experimental_attention_variant is not None:
        return "qwen3_next"
    if m.hybrid_layer_pattern is not None:
        return "mamba2" if set(m.hybrid_layer_pattern.replace("|", "")) == {"M"} else "nemotron_h"
    if m.normalization == "LayerNorm" and not m.swiglu:
        return "gpt2"
    if m.num_experts is not None:
        return "qwen3_moe" if m.qk_layernorm else "mixtral"
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
    out = []
    for f in dataclasses.fields(ModelConfig):
        v, name = getattr(m, f.name), f.name
        if v is None:
            continue
        if name == "num_query_groups" and not m.group_query_attention:
            continue
        if name in ("rotary_base", "rotary_percent") and m.position_embedding_type not in ("rope", "yarn"):
            continue
        if name == "rope_scaling_factor" and not m.use_rope_scaling:
            continue
        if isinstance(v, bool):
            if v != f.default:  # a default-on switch is turned off by its --no- form
                out.append(flag(name) if v else "--no-" + flag(name)[2:])
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
    old = sorted(p.name for p in out.iterdir() if pattern.match(p.name)) if out.is_dir() else []
    if old and not force:
        raise ConversionError(f"{out} already holds {what} ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}); "
                              f"pass --force to replace it, or choose another {flag}")
    return old


def _write_staged(out: Path, old: list[str], write, last: Optional[str] = None) -> None:
    """``write(tmp)`` into a staging directory next to ``out``, then publish it into ``out``."""
    tmp = _staging_dir(out)
    try:
        write(tmp)
        _publish(tmp, out, old, last)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The two directions
# ----------------------------------------------------------------------------------------------

def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else getattr(torch, DTYPES[name])


def to_hf(load, output, family: Optional[str] = None, iteration: Optional[int] = None, dtype: Optional[str] = None,
          force: bool = False, log=None) -> Path:
    """paratron checkpoint ``load`` -> Hugging Face directory ``output``."""
    from ..data.tokenizers import build_tokenizer
    from .hf import save_hf_dir
    from .tokenizer_files import export_tokenizer, tokenizer_config
    log = log or _Log(True)
    load, output = Path(load), Path(output)
    if not load.is_dir():
        raise ConversionError(f"--load {load} is not a directory" if load.exists() else f"--load {load} does not exist")
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"unknown family {family!r}; paratron converts {', '.join(FAMILIES)}")
    old = _check_output(output, _HF_CKPT_FILES, force, "a Hugging Face checkpoint", "--output")
    cfg, vocab, it, state = read_checkpoint(load, iteration, log)
    bert, t5 = cfg.model.model == "bert", cfg.model.model == "t5"
    if bert and family not in (None, "megatron-bert"):
        raise ConversionError(f"--family {family}: {load} holds a BERT, which converts to megatron-bert only")
    if t5 and family not in (None, "t5"):
        raise ConversionError(f"--family {family}: {load} holds a T5, which converts to t5 (T5 v1.1) only")
    fam = "megatron-bert" if bert else "t5" if t5 else family or default_family(cfg.model)
    rows = state["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in state else "?"
    log(f"writing Hugging Face {fam} ({'given' if family else 'from the model config'}), vocabulary {vocab} "
        f"(padded {rows} in paratron), dtype {dtype or 'as saved'}, to {output}")
    extra = {"paratron": {"checkpoint": str(load.resolve()), "iteration": it}}
    tok = tokenizer_config(load, cfg.data)
    if tok is not None and tok.tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        eod = build_tokenizer(tok).eod
        extra.update({} if eod is None else {"eos_token_id": eod})

    def write(tmp: Path) -> None:
        if bert:
            from .hf_bert import save_bert_hf_dir
            save_bert_hf_dir(tmp, state, cfg.model, vocab, _dtype(dtype), extra)
        elif t5:
            from .hf_t5 import save_t5_hf_dir
            save_t5_hf_dir(tmp, state, cfg.model, vocab, _dtype(dtype), extra)
        else:
            save_hf_dir(tmp, state, cfg.model, fam, vocab, dtype=_dtype(dtype), extra_config=extra)
        files = export_tokenizer(tmp, tok) if tok is not None else []
        log(f"tokenizer files: {', '.join(files)}" if files else "no tokenizer files to export (none recorded)")
    _write_staged(output, old, write)
    log(f"done: {output} ({sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters from iteration {it}); "
        f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(output)!r})")
    return output


def _read_hf_config(src: Path) -> dict:
    """The config.json of a Hugging Face model directory (clear errors for a wrong path or file)."""
    if not src.is_dir():
        raise ConversionError(f"--input {src} is not a directory" if src.exists() else f"--input {src} does not exist")
    if not (src / "config.json").is_file():
        raise ConversionError(f"--input {src} has no config.json; pass a Hugging Face model directory")
    try:
        return json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{src / 'config.json'} is not valid JSON (line {e.lineno})") from None


def _hf_state(src: Path, hf_config: dict, tp: int, log):
    """(ModelConfig, vocabulary, family, paratron state, padded vocabulary) of the Hugging Face model in ``src``."""
    from .hf import hf_to_paratron, load_hf_dir
    from .hf_config import model_config_from_hf, padded_vocab_size
    bert = hf_config.get("model_type") in ("bert", "megatron-bert")
    if hf_config.get("model_type") == "t5":  # T5 v1.1 (paratron/checkpoint/hf_t5.py)
        from .hf_t5 import t5_state_from_hf
        m, vocab, state, padded = t5_state_from_hf(hf_config, load_hf_dir(src)[0], tp)
        log(f"reading {src} (t5: {m.num_layers} + {m.decoder_num_layers} layers, hidden {m.hidden_size}, "
            f"vocabulary {vocab})")
        return m, vocab, "t5", state, padded
    if bert:
        from .hf_bert import bert_config_from_hf, bert_hf_to_paratron
        m, vocab, binary = bert_config_from_hf(hf_config)
        family = "megatron-bert"
    else:
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
    state = (bert_hf_to_paratron(hf_state, m, padded, binary) if bert
             else hf_to_paratron(hf_state, m, family, padded, vocab_size=vocab))
    return m, vocab, family, state, padded


def from_hf(input, save, tensor_model_parallel_size: int = 1, dtype: Optional[str] = None, force: bool = False,
            log=None) -> list[str]:
    """Hugging Face directory ``input`` -> paratron checkpoint ``save`` (iteration 0, model weights
    only, whole tensors: any layout loads it); returns the model flags to train it with.
    ``tensor_model_parallel_size`` is the TP of the printed command, whose padded vocabulary the
    checkpoint gets (so that run's padded rows are zeros, not its initialization)."""
    from .tokenizer_files import SUBDIR, save_tokenizer, tokenizer_config
    log = log or _Log(True)
    src, save = Path(input), Path(save)
    tp = int(tensor_model_parallel_size)
    if tp < 1:
        raise ConversionError(f"--tensor-model-parallel-size must be >= 1 (got {tp})")
    hf_config = _read_hf_config(src)
    old = _check_output(save, _PARATRON_CKPT_FILES, force, "a paratron checkpoint", "--save")
    m, vocab, family, state, padded = _hf_state(src, hf_config, tp, log)
    bert = family == "megatron-bert"
    if dtype is not None:
        state = {k: (v.to(_dtype(dtype)) if v.is_floating_point() else v) for k, v in state.items()}
    log(f"converted {len(state)} tensors ({sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters), "
        f"vocabulary padded {vocab} -> {padded}")

    tok_data = tokenizer_config(src)  # the HF tokenizer files travel with the weights, as training saves do

    def tokenizer(tmp: Path) -> None:
        saved = save_tokenizer(tmp, tok_data) if tok_data is not None else None
        log(f"tokenizer saved with it ({SUBDIR}/)" if saved else f"no tokenizer files in {src}: none saved with it")
    converted = {"hf": str(src.resolve()), "family": family}
    _write_weights(save, old + ([SUBDIR] if (save / SUBDIR).is_dir() else []), m, vocab, state, converted, log,
                   tokenizer)
    flags = _print_command(m, tp, save, "pretrain_bert.py" if bert else "pretrain_t5.py" if family == "t5"
                           else "pretrain_gpt.py", log)
    tok = (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {shlex.quote(str(src))}"
           if (src / "tokenizer.json").is_file() else "a tokenizer")
    log(f"use {tok} with {vocab} tokens; the checkpoint has {padded} vocabulary rows (zeros past {vocab}), "
        f"a run that pads to more rows starts the extra ones from its initialization")
    return flags


def _write_weights(save: Path, old: list[str], m, vocab: int, state: dict, converted: dict, log, also=None) -> None:
    """Model weights ``state`` (paratron names, whole tensors) as iteration 0 of a one-rank paratron checkpoint
    in ``save``; ``also(tmp)`` adds files beside it (the tokenizer)."""
    from ..parallel.dims import ParallelDims
    from .state import layout
    cfg = Config(model=m, data=DataConfig(vocab_size=vocab))
    common = {"consumed_samples": 0, "skipped_iterations": 0, "scheduler": None, "optimizer": None, "rng": False,
              "layout": layout(ParallelDims(), None), "config": cfg.to_dict(), "converted_from": converted}
    tensors = {"model." + k: v.contiguous() for k, v in state.items()}

    def write(tmp: Path) -> None:
        sharded.save_full(tmp, 0, tensors, common)
        if also is not None:
            also(tmp)
    log(f"writing a paratron checkpoint (iteration 0, model weights only) to {save}")
    _write_staged(save, old, write, last=sharded.LATEST)


def _print_command(m, tp: int, save: Path, script: str, log) -> list[str]:
    """Print the command that trains from the converted checkpoint; returns its model flags."""
    flags = [f for f in training_flags(m, tp) if f not in ("--model", "bert", "t5")]
    if script == "pretrain_gpt.py" and m.hybrid_layer_pattern:  # (Megatron's script of its hybrid models)
        script = "pretrain_mamba.py"
    launcher = script if tp == 1 else f"torchrun --nproc-per-node {tp} {script}"
    log("done. Train from it with (add your data, tokenizer and training flags; any parallel layout loads it):")
    print(f"  {launcher} {shlex.join(flags)} --load {shlex.quote(str(save))} --finetune", flush=True)
    return flags


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def _run(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    log = _Log(a.quiet)
    if (a.to is None) == (a.frm is None):
        raise ConversionError("pass exactly one of --to hf, --from hf, --from megatron or --from torchtitan "
                              "(see `paratron convert --help`)")
    fmt = (a.to if a.to is not None else a.frm).lower()
    if fmt not in ("hf", "huggingface", "megatron", "torchtitan"):
        raise ConversionError(f"unknown format {fmt!r}: paratron converts to and from hf (Hugging Face), megatron "
                              "(Megatron-LM's torch_dist and torch checkpoints) and torchtitan")
    where = f"--{'to' if a.to else 'from'} {fmt if fmt in ('megatron', 'torchtitan') else 'hf'}"

    def forbid(*names):
        given = [n for n in names if getattr(a, n.lstrip("-").replace("-", "_")) not in (None, False, 1)]
        if given:
            raise ConversionError(f"{given[0]} does not apply to {where}")

    if fmt != "torchtitan":
        forbid("--flavor", "--model-args", "--seq-length")
    if not (a.to and fmt == "megatron"):
        forbid("--expert-model-parallel-size", "--plain-optimizer")
    if a.to is not None and fmt in ("megatron", "torchtitan"):
        forbid("--input", "--save", "--tensor-model-parallel-size", "--family", "--dtype", "--seq-length")
        if not a.load or not a.output:
            raise ConversionError(f"--to {fmt} needs --load CKPT_DIR and --output {fmt.upper()}_DIR")
        if fmt == "torchtitan":
            from .to_torchtitan import export as to_torchtitan
            to_torchtitan(a.load, a.output, a.flavor, a.model_args, a.iteration, a.force, log)
        else:
            from .to_megatron import export
            export(a.load, a.output, a.iteration, a.force, log, a.expert_model_parallel_size, a.plain_optimizer)
    elif a.to is not None:
        forbid("--input", "--save", "--tensor-model-parallel-size")
        if not a.load or not a.output:
            raise ConversionError("--to hf needs --load CKPT_DIR and --output HF_DIR")
        to_hf(a.load, a.output, a.family, a.iteration, a.dtype, a.force, log)
    elif fmt in ("megatron", "torchtitan"):
        forbid("--load", "--output", "--family", "--tensor-model-parallel-size", *["--dtype"] * (fmt == "torchtitan"))
        if not a.input or not a.save:
            raise ConversionError(f"--from {fmt} needs --input DIR (its checkpoint) and --save CKPT_DIR")
        if fmt == "megatron":
            from_megatron(a.input, a.save, a.iteration, a.dtype, a.force, log)
        else:
            from .torchtitan import convert as from_torchtitan
            from_torchtitan(a.input, a.save, a.flavor, a.model_args, a.seq_length, a.iteration, a.force, log)
    else:
        forbid("--load", "--output", "--family", "--iteration")
        if not a.input or not a.save:
            raise ConversionError("--from hf needs --input HF_DIR and --save CKPT_DIR")
        from_hf(a.input, a.save, a.tensor_model_parallel_size, a.dtype, a.force, log)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``paratron convert ...``: 0 on success; 2 with one line on stderr for a user error."""
    from ..errors import run_command
    try:
        return run_command("paratron convert", _run, sys.argv[1:] if argv is None else argv, also=(OSError,))
    except SystemExit as e:  # --help
        return int(e.code or 0)
