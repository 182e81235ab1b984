"""JSONL -> Megatron .bin/.idx, with Megatron's `tools/preprocess_data.py` flags.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json \\
        --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx` (one output per `--json-keys` key). Input lines are
read in order (files of a glob sorted by name, `.gz` decompressed), cut into chunks of about
256 KB, tokenized by `--workers` processes and written in input order, so the output does not
depend on the worker count. A line that is not UTF-8, not JSON, or lacks a key is counted, reported
with its line number and skipped (`--strict` makes it fatal). Outputs are written under temporary
names and renamed only when complete: after an error nothing half-written is left.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from contextlib import ExitStack
from typing import Dict, List, Optional, Tuple

import numpy as np

from paratron.config import add_tokenizer_args, tokenizer_config
from paratron.data.errors import DataError
from paratron.data.indexed import IndexedDatasetWriter, token_dtype
from paratron.data.sentences import split_sentences
from paratron.data.tokenizers import build_tokenizer
from paratron.errors import ArgumentParser, run_command

CHUNK_BYTES = 1 << 18
CHUNK_LINES = 4096
MAX_REPORTED = 20  # malformed lines listed one by one; the rest are only counted


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="paratron preprocess", description="Tokenize JSONL into Megatron .bin/.idx files.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="JSONL file (.gz ok); a glob selects several files, read in name order")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; one output dataset per key")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence (paratron's rule-based splitter, data/sentences.py: punkt's "
                            "main rules, not NLTK); outputs PREFIX_KEY_sentence.bin/.idx")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences: newlines after a sentence stay in it")
    group.add_argument("--lang", default="english",
                       help="with --split-sentences: english only (its abbreviations)")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="append the tokenizer's EOD id to every non-empty document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="outputs are PREFIX_KEY_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="must divide --workers; the output is the same for any value")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="(always the case here: input order is kept)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines (when stderr is not a terminal)")
    group.add_argument("--strict", action="store_true",
                       help="stop on the first malformed line instead of skipping it")
    group.add_argument("--no-progress", action="store_true", help="print no progress at all")
    return parser


# -- worker side ---------------------------------------------------------------------------------
_STATE: Dict[str, object] = {}


def _init_worker(tok_cfg, keys, append_eod: bool, in_process: bool = False, split=None) -> None:
    """``split``: None, or (keep_newlines,) to split each string into sentences (--split-sentences)."""
    if not in_process:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    tokenizer = build_tokenizer(tok_cfg)
    _STATE.update(
        tokenizer=tokenizer, keys=list(keys), append_eod=append_eod,
        dtype=token_dtype(tokenizer.vocab_size), split=split,
    )


def _parse_line(raw: bytes, keys: List[str]):
    """The texts of each key on one line (a list of sentences each), or an error string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 (byte {err.start})"
    try:
        obj = json.loads(text)
    except ValueError as err:
        return f"invalid JSON ({getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')})"
    if not isinstance(obj, dict):
        return "not a JSON object"
    out = []
    for key in keys:
        if key not in obj:
            return f"missing key {key!r}"
        value = obj[key]
        if isinstance(value, str):
            split = _STATE.get("split")
            out.append(split_sentences(value, split[0]) if split else [value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out.append(value)
        else:
            return f"key {key!r} is not a string or a list of strings"
    return out


def _tokenize_docs(docs) -> List[List[List[List[int]]]]:
    """docs[d][k] = sentences -> ids[d][k][s]; raises what the tokenizer raises."""
    tok = _STATE["tokenizer"]
    flat = [s for doc in docs for sentences in doc for s in sentences]
    flat_ids = iter(tok.tokenize_batch(flat))
    return [[[next(flat_ids) for _ in sentences] for sentences in doc] for doc in docs]


def encode_chunk(chunk: Tuple[int, int, List[bytes]]):
    """Tokenize one chunk of input lines. Returns (file index, per-key arrays, documents,
    bytes read, [(line number, problem)])."""
    file_index, first_line, lines = chunk
    keys = _STATE["keys"]
    docs, errors = [], []
    for number, raw in enumerate(lines, first_line):
        if not raw.strip():
            continue  # blank lines (a trailing newline, say) are not documents
        parsed = _parse_line(raw, keys)
        if isinstance(parsed, str):
            errors.append((number, parsed))
        else:
            docs.append((number, parsed))
    try:
        ids = _tokenize_docs([d for _, d in docs])
    except Exception:  # find the culprit lines one by one
        ids, kept = [], []
        for number, doc in docs:
            try:
                ids.append(_tokenize_docs([doc])[0])
                kept.append((number, doc))
            except Exception as err:
                errors.append((number, f"tokenizer failed: {err}"))
        docs = kept
        errors.sort()
    eod, dtype = _STATE["tokenizer"].eod, _STATE["dtype"]
    per_key = []
    for k in range(len(keys)):
        seq_lengths, seqs_per_doc, pieces = [], [], []
        for doc in ids:
            sentences = [s for s in doc[k] if len(s) > 0]
            if sentences and _STATE["append_eod"]:
                sentences[-1] = list(sentences[-1]) + [eod]
            seq_lengths.extend(len(s) for s in sentences)
            seqs_per_doc.append(len(sentences))
            pieces.extend(sentences)
        total = sum(seq_lengths)
        tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=total)
        if total and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
            raise DataError(f"token id {int(tokens.max())} does not fit the {dtype} token dtype")
        per_key.append((tokens.astype(dtype).tobytes(), seq_lengths, seqs_per_doc))
    return file_index, per_key, len(ids), sum(len(x) for x in lines), errors


# -- main side -----------------------------------------------------------------------------------
def _input_files(pattern: str) -> List[str]:
    if os.path.isfile(pattern):
        return [pattern]
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise DataError(f"--input {pattern}: no such file")
    return files


def _read_chunks(files: List[str]):
    for index, path in enumerate(files):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            lines, size, first = [], 0, 1
            for number, line in enumerate(f, 1):
                lines.append(line)
                size += len(line)
                if size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
                    yield index, first, lines
                    lines, size, first = [], 0, number + 1
            if lines:
                yield index, first, lines


class _Progress:
    """tqdm bar on a terminal; plain lines every `interval` documents otherwise."""

    def __init__(self, total_bytes: Optional[int], interval: int, quiet: bool):
        self.start = time.time()
        self.docs = self.bytes = 0
        self.interval, self.quiet, self.next_line = max(1, interval), quiet, max(1, interval)
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="preprocess", file=sys.stderr)

    def rates(self) -> Tuple[float, float]:
        elapsed = max(time.time() - self.start, 1e-9)
        return self.docs / elapsed, self.bytes / elapsed / (1 << 20)

    def update(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.docs} docs, {self.rates()[0]:.0f} docs/s")
        elif not self.quiet and self.docs >= self.next_line:
            docs_s, mb_s = self.rates()
            print(f"processed {self.docs} documents ({docs_s:.1f} docs/s, {mb_s:.2f} MB/s)",
                  file=sys.stderr, flush=True)
            self.next_line = (self.docs // self.interval + 1) * self.interval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_job_flags(args) -> None:
    if args.lang != "english":
        raise DataError(f"--lang {args.lang}: paratron's sentence splitter knows english only")
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be at least 1")
    if args.partitions < 1 or args.workers % args.partitions:
        raise DataError(f"--partitions {args.partitions}: must divide --workers {args.workers}")


def preprocess(args) -> Dict[str, object]:
    """Run the whole job for parsed `args`; raise DataError on bad input. Returns statistics."""
    _check_job_flags(args)
    tok_cfg = tokenizer_config(args)  # the flags and checks of `paratron train`
    files = _input_files(args.input)
    tokenizer = build_tokenizer(tok_cfg)
    if args.append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: tokenizer {args.tokenizer_type} has no EOD token")
    dtype = token_dtype(tokenizer.vocab_size)
    level = "sentence" if args.split_sentences else "document"
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    split = (args.keep_newlines,) if args.split_sentences else None
    total = None if any(f.endswith(".gz") for f in files) else sum(map(os.path.getsize, files))
    progress = _Progress(total, args.log_interval, args.no_progress)
    skipped: List[Tuple[str, int, str]] = []
    tokens = [0] * len(prefixes)

    def consume(result) -> None:
        file_index, per_key, docs, nbytes, errors = result
        for number, problem in errors:
            if args.strict:
                raise DataError(f"{files[file_index]}:{number}: {problem} (--strict)")
            skipped.append((files[file_index], number, problem))
        for k, (data, seq_lengths, seqs_per_doc) in enumerate(per_key):
            writers[k].add_documents(np.frombuffer(data, dtype), seq_lengths, seqs_per_doc)
            tokens[k] += len(data) // dtype.itemsize
        progress.update(docs, nbytes)

    with ExitStack() as stack:
        stack.callback(progress.close)
        writers = [stack.enter_context(IndexedDatasetWriter(p, dtype)) for p in prefixes]
        try:
            if args.workers == 1:
                _init_worker(tok_cfg, args.json_keys, args.append_eod, in_process=True, split=split)
                for chunk in _read_chunks(files):
                    consume(encode_chunk(chunk))
            else:
                ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
                with ctx.Pool(args.workers, initializer=_init_worker,
                              initargs=(tok_cfg, args.json_keys, args.append_eod, False, split)) as pool:
                    pending: deque = deque()
                    for chunk in _read_chunks(files):  # at most ~3 chunks a worker in flight
                        pending.append(pool.apply_async(encode_chunk, (chunk,)))
                        if len(pending) >= 3 * args.workers:
                            consume(pending.popleft().get())
                    while pending:
                        consume(pending.popleft().get())
        except (EOFError, gzip.BadGzipFile) as err:
            raise DataError(f"--input {args.input}: cannot read compressed input ({err})")
        if progress.docs == 0:
            reason = f"all {len(skipped)} lines malformed" if skipped else "empty input"
            raise DataError(f"--input {args.input}: no documents ({reason})")
    docs_s, mb_s = progress.rates()
    return {
        "outputs": prefixes, "documents": progress.docs, "tokens": tokens, "bytes": progress.bytes,
        "seconds": time.time() - progress.start, "docs_per_s": docs_s, "mb_per_s": mb_s,
        "skipped": skipped,
    }


def _main(argv) -> int:
    stats = preprocess(build_parser().parse_args(argv))
    skipped = stats["skipped"]
    for path, number, problem in skipped[:MAX_REPORTED]:
        print(f"warning: {path}:{number}: {problem}; line skipped", file=sys.stderr)
    if len(skipped) > MAX_REPORTED:
        print(f"warning: ... and {len(skipped) - MAX_REPORTED} more malformed lines",
              file=sys.stderr)
    print(
        f"done: {stats['documents']} documents, {sum(stats['tokens'])} tokens, "
        f"{stats['bytes'] / (1 << 20):.1f} MB in {stats['seconds']:.1f} s "
        f"({stats['docs_per_s']:.0f} docs/s, {stats['mb_per_s']:.2f} MB/s); "
        f"{len(skipped)} malformed lines skipped; wrote "
        + ", ".join(p + ".bin/.idx" for p in stats["outputs"]),
        file=sys.stderr,
    )
    return 0


def main(argv=None) -> int:
    """Command-line entry: 0 on success; 2 with one line on stderr (`paratron preprocess: error:
    ...`) for a bad flag, file or input; nothing half-written is left."""
    return run_command("paratron preprocess", _main, sys.argv[1:] if argv is None else argv, also=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
