"""The tokenizer travels with the weights: copied beside every checkpoint and Hugging Face export.

A training checkpoint directory (``--save``) gets ``tokenizer/`` holding copies of the files the
tokenizer flags name (``tokenizer.json`` with its ``tokenizer_config.json`` / ``special_tokens_map.json``,
``vocab.json`` + ``merges.txt``, a SentencePiece or tiktoken model) and ``tokenizer/tokenizer.paratron.json``,
the tokenizer flags with the paths rewritten to those copies. Tokenizers without files (Null,
ByteLevel) are recorded by their flags only. A Hugging Face export gets the same files at its top
level, under the names transformers looks for. :func:`load_tokenizer` finds the tokenizer of a
checkpoint or a Hugging Face directory from these.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

from ..config import TOKENIZER_FIELDS, DataConfig

SUBDIR = "tokenizer"
RECORD = "tokenizer.paratron.json"
_HF_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")
_FILE_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")


def _files(data) -> dict:
    """{field: [source paths]} of the tokenizer files ``data`` (a DataConfig) names."""
    out = {}
    for name in _FILE_FIELDS:
        value = getattr(data, name, None)
        if not value:
            continue
        p = Path(value)
        if name == "tokenizer_model" and data.tokenizer_type == "HuggingFaceTokenizer":
            folder = p if p.is_dir() else p.parent
            main = folder / "tokenizer.json" if p.is_dir() else p
            out[name] = [main] + [folder / f for f in _HF_EXTRAS if (folder / f).is_file()]
        else:
            out[name] = [p]
    return out


def _copy(src: Path, dst: Path, name: Optional[str] = None) -> Path:
    target = dst / (name or src.name)
    if not (target.is_file() and target.read_bytes() == src.read_bytes()):
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(target)
    return target


def save_tokenizer(root, data) -> Optional[Path]:
    """Copy the tokenizer of ``data`` into ``root/tokenizer/`` (unchanged files are left alone); None
    when the flags name no tokenizer or its files are gone."""
    if not getattr(data, "tokenizer_type", None):
        return None
    files = _files(data)
    if any(not p.is_file() for ps in files.values() for p in ps):
        return None
    d = Path(root) / SUBDIR
    d.mkdir(parents=True, exist_ok=True)
    record = {f: getattr(data, f, None) for f in TOKENIZER_FIELDS}
    hf = data.tokenizer_type == "HuggingFaceTokenizer"
    for name, paths in files.items():
        copies = [_copy(p, d, "tokenizer.json" if hf and i == 0 else None) for i, p in enumerate(paths)]
        record[name] = "." if hf else copies[0].name
    (d / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return d


def export_tokenizer(out_dir, data) -> list[str]:
    """Copy the tokenizer of ``data`` into a Hugging Face directory ``out_dir``; the names written."""
    kind = getattr(data, "tokenizer_type", None)
    files = _files(data) if kind else {}
    names = {"vocab_file": "vocab.txt" if str(kind).startswith("BertWordPiece") else "vocab.json",
             "merge_file": "merges.txt"}
    written = []
    for field, paths in files.items():
        for i, p in enumerate(paths):
            if not p.is_file():
                continue
            if field == "tokenizer_model" and kind == "HuggingFaceTokenizer":
                name = "tokenizer.json" if i == 0 else p.name
            elif field == "tokenizer_model":
                name = "tokenizer.model" if "SentencePiece" in kind or kind == "Llama2Tokenizer" else p.name
            else:
                name = names.get(field) if i == 0 and field in names else p.name
            written.append(_copy(p, Path(out_dir), name).name)
    return written


def _data_from(record: dict, base: Path):
    known = {f.name for f in dataclasses.fields(DataConfig)}
    values = {k: v for k, v in record.items() if k in known}
    for name in _FILE_FIELDS:
        if values.get(name):
            values[name] = str((base / values[name]).resolve())
    return DataConfig(**values)


def tokenizer_config(path, data=None):
    """The DataConfig (tokenizer fields) to build the tokenizer of checkpoint / HF directory ``path``:
    its ``tokenizer/`` copy, the HF files at its top, or ``data`` (the run's own flags); None if none."""
    root = Path(path)
    for d in (root / SUBDIR, root):
        if (d / RECORD).is_file():
            return _data_from(json.loads((d / RECORD).read_text()), d)
    if (root / "tokenizer.json").is_file():
        return DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(root))
    if (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        return DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(root / "vocab.json"),
                          merge_file=str(root / "merges.txt"))
    if (root / "vocab.txt").is_file():  # a BERT WordPiece vocabulary (Hugging Face's BERT directories)
        cased = json.loads((root / "tokenizer_config.json").read_text()).get("do_lower_case") is False \
            if (root / "tokenizer_config.json").is_file() else False
        return DataConfig(tokenizer_type="BertWordPieceCase" if cased else "BertWordPieceLowerCase",
                          vocab_file=str(root / "vocab.txt"))
    if (root / "tokenizer.model").is_file():
        return DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(root / "tokenizer.model"))
    if data is not None and getattr(data, "tokenizer_type", None):  # the run's flags, if their files are still there
        return data if all(p.exists() for ps in _files(data).values() for p in ps) else None
    return None


def load_tokenizer(path, data=None):
    """The tokenizer of checkpoint / HF directory ``path`` (see :func:`tokenizer_config`), or None."""
    from ..data.tokenizers import build_tokenizer
    cfg = tokenizer_config(path, data)
    return None if cfg is None else build_tokenizer(cfg)
