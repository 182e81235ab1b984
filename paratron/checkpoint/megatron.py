"""Megatron-LM's own checkpoints, read into paratron's names (``paratron convert --from megatron``).

Megatron writes ``{root}/latest_checkpointed_iteration.txt`` (an iteration, or ``release``) and
``{root}/iter_{N:07d}/`` (or ``release/``) in one of two formats:

* ``torch_dist`` (Megatron's default): a ``torch.distributed.checkpoint`` directory (``.metadata``, ``*.distcp``)
  with ``common.pt`` (iteration, args, checkpoint version) and ``metadata.json``. Every tensor is global: the
  transformer layers are one tensor per parameter with the layer as its first dimension, the routed experts
  one more dimension for the expert, SwiGLU's fc1 ``[gate; up]`` along its rows (or, saved with singleton local
  shards, two keys ``..._w`` / ``..._v``), and the local experts under ``mlp.experts.experts.``.
* ``torch`` (legacy): one ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` per tensor / pipeline /
  expert rank, each the rank's slice: column-parallel weights split along their rows (SwiGLU's fc1 as each rank's
  own ``[gate; up]``), row-parallel ones along their columns, layers and local experts numbered from 0 on each
  rank.

Both become the one-rank, TP=1 state of paratron's model, whose parameter names are Megatron Core's local
spec's: Transformer Engine's norms fused into the next linear (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``) become ``input_layernorm`` / ``pre_mlp_layernorm``, a Transformer Engine grouped
linear's ``weight{e}`` and ``local_experts.{e}`` become paratron's stacked ``experts.linear_fc1.weight`` [E, ...],
and ``_extra_state`` (Transformer Engine's FP8 metadata) is dropped. The model config comes from the ``args``
Megatron saved (paratron's config fields are Megatron's flag names). Conversion reads the model weights, as from
Hugging Face; resuming a run with its optimizer and scheduler state (``--load``) is megatron_state.py.

The files are read by torch's weights-only loader: the ``args`` pickle's ``argparse.Namespace`` is allowed, and the
other classes it names (Megatron's enums) are read as placeholders of those names, so no code from the file's
modules is imported or run; only the plain values are used.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from .hf_config import ConversionError
from . import megatron_hybrid as hybrid
from .pieces import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)\.(.*)$")
# a GPT model's MTP layer: paratron's (and Megatron Core's in-memory) mtp_model_layer is transformer_layer in files
_MTP = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.(.*)$")
# Megatron flags its args hold under another name (store_false flags, and flags generated from Megatron Core's
# config fields): paratron field <- [(dest, inverted)], the first one present that holds a value
_DESTS = {"disable_bias_linear": [("add_bias_linear", True)],
          "no_position_embedding": [("add_position_embedding", True)],
          "bert_no_binary_head": [("bert_binary_head", True)],
          "norm_epsilon": [("norm_epsilon", False), ("layernorm_epsilon", False)],
          "apply_layernorm_1p": [("apply_layernorm_1p", False), ("layernorm_zero_centered_gamma", False)],
          "hybrid_layer_pattern": [("hybrid_layer_pattern", False), ("hybrid_override_pattern", False)]}
# Megatron flags that change what the model computes and that paratron does not build: set in a checkpoint's args,
# the conversion stops rather than build another model (their defaults are off / unset)
_NOT_BUILT = ("apply_residual_connection_post_layernorm", "qk_l2_norm", "mrope_section", "moe_apply_probs_on_input",
              "moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size", "dsa_indexer_n_heads",
              "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json", "use_legacy_models")
# paratron's name <-> Megatron Core's name in its torch_dist files (and Transformer Engine's fused norms anywhere)
_LAYER_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"), ("mlp.experts.", "mlp.experts.experts."))
_FINAL = "decoder.final_layernorm."  # (Megatron's hybrid stack: decoder.final_norm.)
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")


# ----------------------------------------------------------------------------------------------
# Finding a Megatron checkpoint
# ----------------------------------------------------------------------------------------------

def iteration_dir(root: Path, iteration: Optional[int] = None) -> tuple[Path, Optional[int]]:
    """(directory, iteration) of ``root``'s checkpoint: ``iteration``'s, else the tracker's (``release``:
    iteration None)."""
    if iteration is not None:
        return root / f"iter_{iteration:07d}", iteration
    tracker = root / TRACKER
    if not tracker.is_file():
        raise ConversionError(f"{root} has no {TRACKER}: pass the directory Megatron's --save wrote")
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release", None
    if not text.isdigit():
        raise ConversionError(f"{tracker} holds {text[:40]!r}, not an iteration")
    return root / f"iter_{int(text):07d}", int(text)


def checkpoint_format(d: Path) -> Optional[str]:
    """"torch_dist", "torch" (legacy) or None: which Megatron format directory ``d`` holds."""
    if not d.is_dir():
        return None
    if (d / "common.pt").is_file() and (d / ".metadata").is_file():
        return "torch_dist"
    if any((p / LEGACY_FILE).is_file() for p in d.iterdir() if _RANK_DIR.match(p.name)):
        return "torch"
    return None


def locate(root: Path, iteration: Optional[int] = None) -> Optional[tuple[Path, str]]:
    """(iteration directory, format) of the Megatron-LM checkpoint under ``root``, or None when it holds none."""
    try:
        d, _ = iteration_dir(Path(root), iteration)
    except ConversionError:
        return None
    fmt = checkpoint_format(d)
    return None if fmt is None else (d, fmt)


def describe(root: Path, iteration: Optional[int] = None) -> Optional[str]:
    """A one-line description if ``root`` holds a Megatron-LM checkpoint (for --load's error), else None."""
    found = locate(root, iteration)
    return None if found is None else f"{root} holds a Megatron-LM checkpoint ({found[1]} format, {found[0].name})"


def refuse_megatron(root: Path, iteration: Optional[int] = None) -> None:
    """A Megatron-LM checkpoint where paratron's own is looked for: one line naming what reads it."""
    found = locate(root, iteration)
    if found is not None:
        how = "training reads it with --load"
        raise CheckpointError(f"{describe(root, iteration)}: {how}; convert it for everything else: "
                              f"paratron convert --from megatron --input {root} --save NEW_DIR")


def refuse_save_into(root: Path) -> None:
    """--save into Megatron-LM's checkpoint directory would replace its latest_checkpointed_iteration.txt."""
    megatron = describe(root)
    if megatron is not None:
        raise CheckpointError(f"--save {root}: {megatron}; paratron's saves would replace its {TRACKER}: pass "
                              "another --save directory")


# ----------------------------------------------------------------------------------------------
# Reading pickles that name Megatron's classes
# ----------------------------------------------------------------------------------------------

class _Absent:
    """Stands for a class the pickle names (Megatron's enums, ...): kept for its arguments and state only, no code
    of the named module is imported or run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def _torch_load(path: Path) -> dict:
    """torch.load with weights_only=True: argparse.Namespace (Megatron's args) is allowed, and every other class
    the file names is read as an :class:`_Absent` of that name."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        stubs = [(type(n.rsplit(".", 1)[-1], (_Absent,), {"__module__": n.rsplit(".", 1)[0]}), n)
                 for n in names if n != "argparse.Namespace"]
        with torch.serialization.safe_globals([argparse.Namespace, *stubs]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (a damaged or foreign file: one line)
        raise ConversionError(f"cannot read {path}: {e.__class__.__name__}: {str(e).splitlines()[0][:160]}") from None


def _args(obj) -> dict:
    if isinstance(obj, argparse.Namespace):
        return vars(obj)
    if isinstance(obj, dict):
        return obj
    raise ConversionError("the checkpoint holds no Megatron args (saved without them?): paratron needs the model "
                          "flags it was trained with")


# ----------------------------------------------------------------------------------------------
# The two formats
# ----------------------------------------------------------------------------------------------

def _read_dist(d: Path) -> tuple[dict, dict]:
    """(common state: args, iteration, checkpoint_version; the model's tensors in Megatron Core's names)."""
    from . import sharded
    common = _torch_load(d / "common.pt")
    args = _args(common.get("args"))
    shapes = sharded.tensor_shapes(d)
    keys = [k for k in shapes if not k.startswith(("optimizer.", "rng_state", "rerun_state")) and
            "_extra_state" not in k]
    if not keys:
        raise ConversionError(f"{d} holds no model tensors")
    state = sharded.load_full(d, keys)
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    return common, _unstack(hybrid.join_parts(state), args)


def _unstack(state: dict, args: dict) -> dict:
    """torch_dist's global tensors -> one tensor per layer (and stacked experts as paratron keeps them)."""
    out = {}
    layers = args.get("num_layers")
    for k in sorted(state):
        v = state[k]
        if k.endswith(("_w", "_v")) and k[:-2].endswith("linear_fc1.weight"):  # singleton SwiGLU halves
            if k.endswith("_v"):
                continue
            v, k = torch.cat([v, state[k[:-2] + "_v"]], dim=-2), k[:-2]
        m = re.match(r"^(.*?decoder\.)layers\.(.*)$", k)
        if m is None or re.match(r"^\d+\.", m.group(2)):  # (heterogeneous layers keep a key per layer)
            out[k] = v
            continue
        if v.shape[0] != layers:
            raise ConversionError(f"{k}: {v.shape[0]} layers along its first dimension, the args say {layers}")
        rest = m.group(2)
        for i in range(layers):
            out[f"{m.group(1)}layers.{i}.{rest}"] = v[i].clone()
    return out


# ----------------------------------------------------------------------------------------------
# Loading a torch_dist checkpoint straight into a run's pieces (--load DIR --finetune)
# ----------------------------------------------------------------------------------------------

def dist_pieces(pieces: list, d: Path, prefixes: Optional[dict] = None) -> list:
    """This rank's pieces (paratron's keys, global shapes) as pieces of Megatron's torch_dist checkpoint ``d``: its
    names, a layer's tensor at its index along the stacked layer dimension (or under its own per-layer key where
    Megatron saved one). ``prefixes``: {paratron's key prefix: Megatron's, or a tuple of candidates (the first that
    the checkpoint has wins)} (default: the model's, ``model.`` -> none; megatron_state.prefixes gives the
    optimizer's too). The views write through to the run's tensors."""
    from . import sharded
    prefixes = prefixes or {"model.": ""}
    layers = {k: s for k, (s, _) in sharded.tensor_shapes(d).items()}
    out = []
    for p in pieces:
        ours = next((a for a in prefixes if p.key.startswith(a)), "")
        options = prefixes.get(ours, "")
        found = [_dist_piece(p, theirs, p.key[len(ours):], layers)
                 for theirs in (options if isinstance(options, tuple) else (options,))]
        piece = next((piece for piece, saved in found if saved), found[0][0])
        blocks = hybrid.block_pieces(piece, piece.key, layers)  # (a hybrid model's Mamba in_proj / conv1d)
        out += [piece] if blocks is None else blocks
    return out


def _dist_piece(p, theirs: str, key: str, layers: dict) -> tuple:
    """(``p`` as a piece of Megatron's tensor ``theirs + key``, whether the checkpoint has that tensor)."""
    from .pieces import Piece
    mtp = _MTP.match(key)
    if mtp is not None:
        rest = mtp.group(2)
        names = [f"{theirs}{mtp.group(1)}transformer_layer.{r}" for r in
                 [rest] + [rest.replace(a, b, 1) for a, b in _LAYER_NAMES if rest.startswith(a)]]
        found = [n for n in names if n in layers]
        return Piece((found or names)[0], p.shape, p.offsets, p.tensor), bool(found)
    m = _LAYER.match(key)
    if m is None:
        final = [theirs + "decoder.final_norm." + key[len(_FINAL):]] if key.startswith(_FINAL) else []
        names = [theirs + key] + final
        name = next((n for n in names if n in layers), names[0])
        return Piece(name, p.shape, p.offsets, p.tensor, p.vocab_rows), name in layers
    pre, i, rest = theirs + m.group(1), int(m.group(2)), m.group(3)
    names = [rest] + [rest.replace(a, b, 1) for a, b in _LAYER_NAMES if rest.startswith(a)] + hybrid.candidates(rest)
    stacked = [f"{pre}{r}" for r in names if f"{pre}{r}" in layers]
    own = [f"{pre}{i}.{r}" for r in names if f"{pre}{i}.{r}" in layers or f"{pre}{i}.{r}.x" in layers]
    if own or not stacked:
        return Piece(own[0] if own else f"{pre}{names[-1]}", p.shape, p.offsets, p.tensor), bool(own)
    n = layers[stacked[0]][0]
    return Piece(stacked[0], (n, *p.shape), (i, *p.offsets), p.tensor.unsqueeze(0)), True


def saved_model_args(root: Path, iteration: Optional[int] = None) -> tuple[dict, dict]:
    """(paratron's model fields that the checkpoint's args set, the args) of Megatron checkpoint ``root``
    (--use-checkpoint-args): its common.pt (torch_dist) or a rank file's (legacy)."""
    d, fmt = locate(root, iteration)
    from . import sharded
    files = [d / "common.pt"] if fmt == "torch_dist" else sorted(d.glob(f"mp_rank_*/{LEGACY_FILE}"))
    top = _torch_load(files[0])
    keys = sharded.tensor_shapes(d) if fmt == "torch_dist" else [
        k for name, chunk in top.items() if re.fullmatch(r"model\d*", name) for k in chunk]
    args = hybrid.marked(_args(top.get("args")), keys)
    m = model_config(args)
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelConfig)}, args


def dist_common(d: Path) -> tuple[dict, ModelConfig, int]:
    """(common state, model config, vocabulary rows) of torch_dist checkpoint directory ``d``."""
    from . import sharded
    common = _torch_load(d / "common.pt")
    shapes = sharded.tensor_shapes(d)
    rows = shapes.get("embedding.word_embeddings.weight", ((0,),))[0][0]
    return common, model_config(hybrid.marked(_args(common.get("args")), shapes)), rows


# ----------------------------------------------------------------------------------------------
# Megatron Core names -> paratron's
# ----------------------------------------------------------------------------------------------

def to_paratron(state: dict) -> dict:
    """Megatron Core state (whole tensors, global layer numbers) -> paratron's names and expert stacking."""
    out, experts = {}, defaultdict(dict)
    for k, v in state.items():
        for ours, theirs in _LAYER_NAMES:
            k = k.replace(theirs, ours)
        k = re.sub(r"^(mtp\.layers\.\d+\.)transformer_layer\.", r"\1mtp_model_layer.", k)
        m = re.match(r"^(.*mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$", k)
        m = m or re.match(r"^(.*mlp\.experts\.)()(linear_fc[12]\.(?:weight|bias))(\d+)$", k)
        if m is not None:
            e = int(m.group(2) or m.group(4))
            experts[m.group(1) + m.group(3)][e] = v
            continue
        out[k] = v
    for k, by_e in experts.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise ConversionError(f"{k}: experts {sorted(by_e)} found, not 0 .. {len(by_e) - 1}")
        out[k] = torch.stack([by_e[e] for e in range(len(by_e))])
    return out


def model_config(args: dict) -> ModelConfig:
    """paratron's model config from Megatron's saved args (same names; store_false flags inverted)."""
    unbuilt = [n for n in _NOT_BUILT if args.get(n) and not isinstance(args[n], _Absent)]
    if unbuilt:
        raise ConversionError(f"the checkpoint was trained with --{unbuilt[0].replace('_', '-')}, which paratron's "
                              "model does not build; its weights would compute something else")
    kw = {}
    for f in dataclasses.fields(ModelConfig):
        found = [(d, inv) for d, inv in _DESTS.get(f.name, [(f.name, False)])
                 if args.get(d) is not None and not isinstance(args[d], _Absent)]
        if not found:
            continue
        dest, inverted = found[0]
        if f.name in ("encoder_num_layers", "encoder_seq_length"):  # (Megatron copies a GPT's sizes into them)
            continue
        if f.name in ("hybrid_override_pattern", "spec"):  # (the first read as --hybrid-layer-pattern; --spec names
            continue  # the code that built the layers: the weights are read by their names, strictly)
        if f.name.startswith("moe_") and not args.get("num_experts"):  # (Megatron keeps its MoE defaults in a
            continue  # dense run's args; paratron takes an MoE flag without --num-experts for a mistake)
        value = (not args[dest]) if inverted else args[dest]
        if str(value) != str(f.default):  # (Megatron's args hold parsed values: --moe-layer-freq 1 as the int 1)
            kw[f.name] = value
    try:
        return ModelConfig(**kw).resolved()
    except (ConfigError, TypeError, ValueError) as e:
        raise ConversionError(f"the checkpoint's model flags do not build a paratron model: {e}") from None


def read(root, iteration: Optional[int] = None) -> tuple[ModelConfig, dict, Optional[int], int, str]:
    """(model config, paratron state, iteration, padded vocabulary rows, format) of Megatron checkpoint ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise ConversionError(f"--input {root} is not a directory" if root.exists()
                              else f"--input {root} does not exist")
    d, _ = iteration_dir(root, iteration)
    fmt = checkpoint_format(d)
    if fmt is None:
        raise ConversionError(f"{d} is not a Megatron-LM checkpoint (no common.pt + .metadata, no "
                              f"mp_rank_*/{LEGACY_FILE})" if d.exists() else f"{d} does not exist")
    from . import megatron_legacy
    try:
        top, state = _read_dist(d) if fmt == "torch_dist" else megatron_legacy.read_legacy(d)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    args, it, version = _args(top.get("args")), top.get("iteration"), top.get("checkpoint_version")
    args = hybrid.marked(args, state)
    if hybrid.is_hybrid(args):
        state = {hybrid.to_paratron_name(k): v for k, v in state.items()}
    if isinstance(version, (int, float)) and version < 3:
        raise ConversionError(f"checkpoint version {version}: Megatron's layouts before version 3 (older QKV order) "
                              "are not read; load and save it once with a current Megatron-LM")
    state = to_paratron(state)
    m = model_config(args)
    rows = state["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in state else 0
    return m, state, it, rows, fmt


def from_megatron(input, save, iteration: Optional[int] = None, dtype: Optional[str] = None, force: bool = False,
                  log=None) -> list[str]:
    """Megatron-LM checkpoint ``input`` (torch_dist or legacy torch format, any TP / PP / EP) -> paratron
    checkpoint ``save`` (iteration 0, model weights only, whole tensors: any layout loads it); returns the model
    flags to train it with."""
    from .convert import _PARATRON_CKPT_FILES, _Log, _check_output, _dtype, _print_command, _write_weights
    log = log or _Log(True)
    save = Path(save)
    old = _check_output(save, _PARATRON_CKPT_FILES, force, "a paratron checkpoint", "--save")
    m, state, it, rows, fmt = read(input, iteration)
    if dtype is not None:
        state = {k: (v.to(_dtype(dtype)) if v.is_floating_point() else v) for k, v in state.items()}
    log(f"read {input} ({fmt} format, iteration {it if it is not None else 'release'}: {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {len(state)} tensors, {sum(t.numel() for t in state.values()) / 1e6:.2f}M "
        f"parameters, {rows} vocabulary rows); optimizer, scheduler and RNG state are not converted")
    converted = {"megatron": str(Path(input).resolve()), "iteration": it, "format": fmt}
    _write_weights(save, old, m, rows, state, converted, log)
    flags = _print_command(m, 1, save, "pretrain_gpt.py", log)
    log(f"use the tokenizer the Megatron run used; the checkpoint has its {rows} vocabulary rows")
    return flags
