"""The embedded demo corpus: the running Python's own standard library sources.

Every machine with Python has it, nothing is downloaded, and it is real text (code, comments,
docstrings), enough to watch a small model learn. The chain

    python_stdlib_corpus -> train_bpe_tokenizer -> preprocess -> .bin/.idx -> train

is what `prepare_demo_data` runs, reusing whatever a previous call already produced.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Dict, Iterator, Optional, Tuple

from paratron.data.errors import DataError
from paratron.data.indexed import dataset_exists

# encodings/ is mostly generated character tables: poor text to learn from.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
DEMO_MAX_BYTES = 8 << 20
DEMO_VOCAB_SIZE = 4096


def stdlib_source_files(root: Optional[str] = None) -> Iterator[Tuple[str, str]]:
    """(relative path, absolute path) of each .py file of the standard library, in a fixed
    pseudo-random order (sorted by the MD5 of the relative path, the same on every machine with the
    same library), so that a size cap and the train/validation split both sample the whole library;
    third-party packages and test suites are left out."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    return iter(sorted(found, key=lambda rel_abs: hashlib.md5(rel_abs[0].encode()).hexdigest()))


def python_stdlib_corpus(out_jsonl: str, max_bytes: Optional[int] = None) -> Dict[str, int]:
    """Write the standard library's .py sources as JSONL, one {"text": source} per file, in the
    order of `stdlib_source_files`, stopping before the text would pass `max_bytes` (UTF-8). Returns counts."""
    files = written = 0
    os.makedirs(os.path.dirname(os.path.abspath(out_jsonl)), exist_ok=True)
    tmp = f"{out_jsonl}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for _, path in stdlib_source_files():
                try:
                    with open(path, "rb") as f:
                        raw = f.read()
                    text = raw.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip():
                    continue
                if max_bytes is not None and written + len(raw) > max_bytes and files:
                    break
                out.write(json.dumps({"text": text}) + "\n")
                files += 1
                written += len(raw)
        if not files:
            raise DataError(f"{sysconfig.get_paths()['stdlib']}: no readable .py files found")
        os.replace(tmp, out_jsonl)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"files": files, "bytes": written}


def prepare_demo_data(
    workdir: str, vocab_size: int = DEMO_VOCAB_SIZE, max_bytes: int = DEMO_MAX_BYTES,
    workers: int = 2,
) -> Tuple[str, str]:
    """Corpus -> byte-level BPE tokenizer -> .bin/.idx under `workdir`, each step skipped when its
    output is there from an earlier call with the same settings. Returns (data prefix for
    --data-path, tokenizer.json for --tokenizer-model with HuggingFaceTokenizer)."""
    from paratron.data.bpe_train import train_bpe_tokenizer
    from paratron.data.preprocess import build_parser, preprocess

    os.makedirs(workdir, exist_ok=True)
    corpus = os.path.join(workdir, "stdlib.jsonl")
    tokenizer = os.path.join(workdir, "tokenizer.json")
    prefix = os.path.join(workdir, "stdlib")
    data_prefix = prefix + "_text_document"
    stamp_path = os.path.join(workdir, "demo.json")
    stamp = {"vocab_size": vocab_size, "max_bytes": max_bytes,
             "python": sysconfig.get_paths()["stdlib"]}
    old = None
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            old = json.load(f)
    if old != stamp:  # other settings (or none recorded): start over
        for path in (corpus, tokenizer, data_prefix + ".bin", data_prefix + ".idx"):
            if os.path.exists(path):
                os.remove(path)
    if not os.path.isfile(corpus):
        python_stdlib_corpus(corpus, max_bytes)
    if not os.path.isfile(tokenizer):
        train_bpe_tokenizer([corpus], vocab_size, tokenizer)
    if not dataset_exists(data_prefix):
        args = build_parser().parse_args([
            "--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
            "--append-eod", "--workers", str(workers), "--no-progress",
        ])
        preprocess(args)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return data_prefix, tokenizer


def stdlib_docstring_corpus(out_jsonl: str) -> int:
    """English prose from the standard library: one JSON line per module, its module, class and function
    docstrings (of more than four words) whitespace-joined, kept when it has at least two sentences. Returns
    the number of documents written."""
    import ast

    n = 0
    with open(out_jsonl, "w", encoding="utf-8") as out:
        for _, path in stdlib_source_files():
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            docs = [ast.get_docstring(node) for node in ast.walk(tree)
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            text = " ".join(" ".join(d.split()) for d in docs if d and len(d.split()) > 4)
            if text.count(". ") >= 2:
                out.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


def prepare_docstring_data(workdir: str, vocab_size: int = 4000) -> Dict[str, str]:
    """The stdlib docstrings as BERT and GPT data under ``workdir``: a WordPiece vocab.txt trained on them,
    ``{prefix}_text_sentence`` (--split-sentences, BERT's) and ``{prefix}_text_document`` (--append-eod,
    GPT's), both tokenized with BertWordPieceLowerCase. Returns {"bert", "gpt", "vocab", "documents"}."""
    from paratron.data.preprocess import build_parser, preprocess
    from paratron.data.wordpiece import train_wordpiece_vocab

    os.makedirs(workdir, exist_ok=True)
    corpus, vocab = os.path.join(workdir, "docstrings.jsonl"), os.path.join(workdir, "vocab.txt")
    documents = stdlib_docstring_corpus(corpus)
    with open(corpus, encoding="utf-8") as f:
        train_wordpiece_vocab((json.loads(line)["text"] for line in f), vocab, vocab_size)
    common = ["--input", corpus, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
              "--workers", "1", "--no-progress"]
    for level, extra in (("bert", ["--split-sentences"]), ("gpt", ["--append-eod"])):
        preprocess(build_parser().parse_args([*common, "--output-prefix", os.path.join(workdir, level), *extra]))
    return {"bert": os.path.join(workdir, "bert_text_sentence"), "gpt": os.path.join(workdir, "gpt_text_document"),
            "vocab": vocab, "documents": str(documents)}
