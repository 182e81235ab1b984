"""Checks of the data section: the data sources, the tokenizer flags (shared by train and preprocess),
fill-in-the-middle (--fim-*) and supervised fine-tuning (--sft-*)."""
from __future__ import annotations

import difflib
import json
import math
import re

from ..errors import ConfigError
from .ranges import check_ranges
from .rules import changed_flags, need
from .sections import DataConfig
from .values import SFT_PROMPT_FORMATS, TIKTOKEN_PATTERNS, TOKENIZER_TYPES, WORDPIECE_TYPES


def _read(path: str, flag_name: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag_name} {path}: cannot read it ({e.strerror or e}); give a readable file") from None


def read_data_path_files(d: DataConfig) -> None:
    """Megatron's --data-args-path (a text file of --data-path's values) and --per-split-data-args-path (JSON with
    a "train", "valid" and "test" blend, each a list or a string of [WEIGHT] PREFIX items) into the path fields.
    Read again (a config checked twice), a file gives the same paths: no conflict with itself."""
    if d.data_args_path is not None:
        items = _read(d.data_args_path, "--data-args-path").split()
        need(bool(items), f"--data-args-path {d.data_args_path} is empty; it holds --data-path's values")
        need(not d.data_path or d.data_path == items, "--data-args-path and --data-path both give the data: use one")
        d.data_path = items
    if d.per_split_data_args_path is not None:
        _read_per_split(d)


def _read_per_split(d: DataConfig) -> None:
    where = f"--per-split-data-args-path {d.per_split_data_args_path}"
    try:
        splits = json.loads(_read(d.per_split_data_args_path, "--per-split-data-args-path"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg}, line {e.lineno}); write {{\"train\": [...], "
                          f"\"valid\": [...], \"test\": [...]}}") from None
    need(isinstance(splits, dict) and "train" in splits, f"{where}: needs a \"train\" entry (and \"valid\", "
         "\"test\"), each a list or a string of [WEIGHT] PREFIX items")
    paths = {}
    for split in ("train", "valid", "test"):
        value = splits.get(split)
        items = value.split() if isinstance(value, str) else value
        need(items is None or (isinstance(items, list) and all(isinstance(i, (str, int, float)) for i in items)),
             f"{where}: \"{split}\" must be a list or a string of [WEIGHT] PREFIX items")
        paths[f"{split}_data_path"] = [str(i) for i in items] if items else None
    given = {name: getattr(d, name) for name in paths}
    need(not d.data_path and all(v is None or v == paths[n] for n, v in given.items()),
         "--per-split-data-args-path gives each split's data: remove --data-path and --train/valid/test-data-path")
    for name, value in paths.items():
        setattr(d, name, value)


def validate_data(d: DataConfig, default_tokenizer: str = "GPT2BPETokenizer") -> None:
    """``default_tokenizer``: the --tokenizer-type a --vocab-file means when none is given (pretrain_gpt.py's
    GPT2BPETokenizer; pretrain_bert.py's BertWordPieceLowerCase)."""
    read_data_path_files(d)
    have_data = d.mock_data or d.data_path or d.train_data_path
    need(bool(have_data), "no training data: pass --data-path PREFIX (or --train-data-path) or --mock-data")
    need(not (d.mock_data and (d.data_path or d.train_data_path)),
         "--mock-data and --data-path are mutually exclusive; choose one")
    if d.tokenizer_type is None and (d.vocab_file or d.merge_file):
        d.tokenizer_type = default_tokenizer  # Megatron's default tokenizer of the entry point
    wordpiece = d.tokenizer_type in WORDPIECE_TYPES
    need(d.tokenizer_type in (None, "GPT2BPETokenizer") or not (d.vocab_file or d.merge_file) or wordpiece,
         f"--vocab-file/--merge-file are read only by GPT2BPETokenizer (and --vocab-file by BertWordPiece*), not "
         f"--tokenizer-type {d.tokenizer_type}; remove them or use --tokenizer-type GPT2BPETokenizer")
    need(not (wordpiece and d.merge_file), f"--tokenizer-type {d.tokenizer_type} reads --vocab-file only: remove "
         "--merge-file")
    if d.tokenizer_type is None and d.mock_data:
        # No tokenizer flags with mock data: a NullTokenizer over the GPT-2 vocabulary size (its EOD,
        # vocab_size - 1 = 50256, is GPT-2's end-of-text id).
        d.tokenizer_type = "NullTokenizer"
        d.vocab_size = d.vocab_size or 50257
    validate_tokenizer(d)
    split_numbers(d.split)


def split_numbers(split: str) -> list[float]:
    """``--split 969,30,1`` -> [969.0, 30.0, 1.0]: one to three numbers >= 0, separated by commas (or
    Megatron's slashes), not all zero. Megatron reads any run of digits and dots (``99,abc`` as 99, ``99,-1,2``
    as 99,1,2); paratron refuses what is not a number instead of training on another split."""
    text = str(split).strip()
    parts = [p.strip() for p in re.split(r"[,/]", text)]
    out = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"--split {text!r}: {part!r} is not a number; give up to three proportions "
                              "train,valid,test such as 969,30,1") from None
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"--split {text!r}: {part} is not a proportion >= 0; give up to three such as 969,30,1")
        out.append(value)
    need(len(out) <= 3, f"--split {text!r}: at most three numbers (train, valid, test)")
    need(sum(out) > 0, f"--split {text!r}: needs at least one positive number")
    return out


def validate_tokenizer(d: DataConfig) -> None:
    """The tokenizer flags (shared by train and preprocess)."""
    check_ranges(d)
    need(d.tokenizer_type is not None, "set the tokenizer with --tokenizer-type (and its files); see docs/data.md")
    if d.tokenizer_type not in TOKENIZER_TYPES:
        close = ([t for t in TOKENIZER_TYPES if t.lower().startswith(d.tokenizer_type.lower())]
                 or difflib.get_close_matches(d.tokenizer_type, TOKENIZER_TYPES, n=1))
        hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(TOKENIZER_TYPES)}"
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type} is not supported; {hint}")
    if d.tokenizer_type == "NullTokenizer":
        need(d.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size N")
    need(d.tiktoken_pattern in TIKTOKEN_PATTERNS, f"--tiktoken-pattern must be v1 or v2 (got {d.tiktoken_pattern})")


def validate_fim(data) -> None:
    """--fim-*: no effect without --fim-data (a changed one is an error), not with mock data (nothing to
    re-tokenize: Megatron refuses it too), and a fragment rate with --fim-split-sample."""
    if not data.fim_data:
        changed = changed_flags(data, prefix="fim_")
        need(not changed, f"{', '.join(changed)}: no effect without --fim-data; add it or remove them")
        return
    need(not data.mock_data, "--fim-data needs real data (it re-tokenizes text); --mock-data has none")
    need(data.fim_split_sample is None or data.fim_fragment_rate is not None,
         "--fim-split-sample needs --fim-fragment-rate (the chance per fragment)")


def validate_sft(data) -> None:
    """--sft: conversations through a HuggingFace tokenizer (Megatron's SFT tokenizer is one too), real
    JSONL data, not FIM; --sft-tokenizer-prompt-format a known format, and no effect without --sft."""
    if not data.sft:
        changed = changed_flags(data, prefix="sft_")
        need(not changed, f"{', '.join(changed)}: no effect without --sft; add it or remove them")
        return
    need(data.sft_tokenizer_prompt_format in SFT_PROMPT_FORMATS, f"--sft-tokenizer-prompt-format must be one of "
         f"{', '.join(SFT_PROMPT_FORMATS)} (got {data.sft_tokenizer_prompt_format})")
    need(data.tokenizer_type == "HuggingFaceTokenizer", "--sft renders conversations with a HuggingFace "
         f"tokenizer's vocabulary; give --tokenizer-type HuggingFaceTokenizer (got {data.tokenizer_type})")
    need(not data.mock_data, "--sft reads conversations from JSONL files (--data-path); --mock-data has none")
    need(not data.fim_data, "--sft and --fim-data do not go together: FIM rewrites pretraining text, SFT "
         "samples are conversations")
