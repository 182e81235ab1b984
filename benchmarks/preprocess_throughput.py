"""Preprocessing throughput: paratron's tools/preprocess_data.py against megatron-core's path.

    python benchmarks/preprocess_throughput.py [--size-mb 200] [--workers 2]

1. Generates a JSONL corpus of synthetic but text-like documents (Zipf-distributed English words
   taken from the Python standard library's docstrings and comments, sentences, paragraphs,
   numbers, some non-ASCII), deterministic for a seed.
2. Trains a byte-level BPE (paratron's train_bpe_tokenizer) on its first 16 MB.
3. Runs paratron's `tools/preprocess_data.py --workers N --append-eod` with that tokenizer
   (HuggingFaceTokenizer), wall clock of the whole command.
4. Runs megatron-core's equivalent. The megatron-core wheel does not ship
   tools/preprocess_data.py, so its path is reproduced here as that script does it: a
   multiprocessing.Pool of N workers, each with the same tokenizer loaded through transformers
   (Megatron's HuggingFaceTokenizer calls `AutoTokenizer(...)(text).input_ids`), `pool.imap(encode,
   lines, 32)`, json.loads + tokenize + EOD per line, and megatron-core's IndexedDatasetBuilder
   (add_document / finalize) writing the .bin/.idx.
5. Checks that both outputs are byte-identical and writes a dated record to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# -- corpus ---------------------------------------------------------------------------------------
def _word_list():
    from paratron.data.corpus import stdlib_source_files

    counts = {}
    for _, path in stdlib_source_files():
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        for chunk in re.findall(r'"""(.*?)"""|#([^\n]*)', text, flags=re.S):
            for word in re.findall(r"[A-Za-z][a-z]{1,14}", chunk[0] or chunk[1]):
                counts[word.lower()] = counts.get(word.lower(), 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))[:20000]
    return words + ["café", "naïve", "Zürich", "東京", "données", "€", "—", "…"]


def generate_corpus(path: str, size_mb: float, seed: int = 0) -> dict:
    words = np.array(_word_list(), dtype=object)
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, len(words) + 1)
    probs = 1.0 / ranks**1.1
    probs /= probs.sum()
    target, written, docs = int(size_mb * (1 << 20)), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            picks = words[rng.choice(len(words), size=4096, p=probs)]
            lengths = rng.integers(4, 28, size=200)
            sentences, pos = [], 0
            for n in lengths:
                if pos + n > len(picks):
                    break
                s = " ".join(picks[pos:pos + n])
                if rng.random() < 0.15:
                    s += f" {int(rng.integers(0, 10000))}"
                sentences.append(s[:1].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"]))
                pos += n
            paragraphs, i = [], 0
            while i < len(sentences):
                k = int(rng.integers(1, 8))
                paragraphs.append(" ".join(sentences[i:i + k]))
                i += k
            cut = int(rng.integers(1, len(paragraphs) + 1))
            line = json.dumps({"text": "\n\n".join(paragraphs[:cut]), "id": docs},
                              ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    return {"documents": docs, "bytes": written}


# -- megatron-core's path -------------------------------------------------------------------------
_TOK = {}


def _mc_init(tokenizer_json):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import PreTrainedTokenizerFast

    _TOK["t"] = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
    _TOK["eod"] = _TOK["t"].convert_tokens_to_ids("<|endoftext|>")


def _mc_encode(line):
    text = json.loads(line)["text"]
    ids = _TOK["t"](text).input_ids
    lens = [len(ids)] if ids else []
    if ids:
        ids.append(_TOK["eod"])
        lens[-1] += 1
    return ids, lens, len(line)


def run_megatron_core(inp: str, prefix: str, tokenizer_json: str, workers: int) -> float:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from transformers import PreTrainedTokenizerFast

    start = time.time()
    vocab = len(PreTrainedTokenizerFast(tokenizer_file=tokenizer_json))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    with open(inp, encoding="utf-8") as fin, multiprocessing.get_context("fork").Pool(
            workers, initializer=_mc_init, initargs=(tokenizer_json,)) as pool:
        for ids, lens, _ in pool.imap(_mc_encode, fin, 32):
            builder.add_document(ids, lens)
    builder.finalize(prefix + ".idx")
    return time.time() - start


# -- record ---------------------------------------------------------------------------------------
def _versions():
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "tokenizers", "transformers", "megatron-core"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "-"
    try:
        out["paratron commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short",
                                                 "HEAD"], capture_output=True, text=True
                                                ).stdout.strip()
    except OSError:
        out["paratron commit"] = "-"
    return out


def _machine():
    cpu = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--workdir", default="/tmp/paratron_preprocess_bench")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each path, interleaved (the machine may be shared)")
    parser.add_argument("--record", default=None, help="output .md (default: dated, in results/)")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    inp = os.path.join(args.workdir, f"corpus_{args.size_mb:g}mb.jsonl")
    if not os.path.isfile(inp):
        t = time.time()
        info = generate_corpus(inp, args.size_mb)
        print(f"corpus: {info['documents']} docs, {info['bytes'] / 2**20:.1f} MB "
              f"in {time.time() - t:.1f} s", file=sys.stderr)
    size_mb = os.path.getsize(inp) / (1 << 20)
    docs = sum(1 for _ in open(inp, "rb"))
    tok = os.path.join(args.workdir, f"tokenizer_{args.vocab_size}.json")
    if not os.path.isfile(tok):
        from paratron.data.bpe_train import train_bpe_tokenizer

        sample = os.path.join(args.workdir, "sample.jsonl")
        with open(inp, "rb") as fin, open(sample, "wb") as fout:
            fout.write(fin.read(16 << 20).rsplit(b"\n", 1)[0] + b"\n")
        train_bpe_tokenizer([sample], args.vocab_size, tok)

    command = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", inp,
               "--output-prefix", os.path.join(args.workdir, "paratron"), "--tokenizer-type",
               "HuggingFaceTokenizer", "--tokenizer-model", tok, "--append-eod", "--workers",
               str(args.workers), "--log-interval", "20000"]
    load_start = os.getloadavg()
    ours = os.path.join(args.workdir, "paratron_text_document")
    theirs = os.path.join(args.workdir, "megatron_text_document")
    times = {"paratron tools/preprocess_data.py": [],
             "megatron-core path (Pool.imap + IndexedDatasetBuilder)": []}
    names = list(times)
    for _ in range(args.repeat):
        t = time.time()
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=REPO))
        times[names[0]].append(time.time() - t)
        if not args.skip_megatron:
            times[names[1]].append(run_megatron_core(inp, theirs, tok, args.workers))
    identical = "-"
    if not args.skip_megatron:
        identical = all(open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()
                        for ext in (".bin", ".idx"))
    rows = [(name, sorted(ts)) for name, ts in times.items() if ts]
    load = f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end"

    today = datetime.date.today().isoformat()
    record = args.record or os.path.join(REPO, "benchmarks", "results",
                                         f"preprocess_throughput_{today}.md")
    versions = _versions()
    lines = [
        f"# Preprocessing throughput, {today}", "",
        f"- machine: {_machine()}; {load}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- input: {size_mb:.1f} MB JSONL, {docs} documents (synthetic text, "
        "benchmarks/preprocess_throughput.py)",
        f"- tokenizer: byte-level BPE, vocab {args.vocab_size}, trained on the first 16 MB "
        "(tokenizer.json, HuggingFaceTokenizer), `--append-eod`",
        f"- workers: {args.workers}; wall clock of the whole run, process start included; "
        f"{args.repeat} runs of each path, interleaved; MB/s of the best run",
        f"- outputs byte-identical: {identical}",
        f"- command: `python benchmarks/preprocess_throughput.py --size-mb {args.size_mb:g} "
        f"--workers {args.workers} --repeat {args.repeat}`", "",
        "| path | seconds (all runs) | MB/s | docs/s |", "|---|---:|---:|---:|",
    ]
    for name, seconds in rows:
        best = seconds[0]
        runs = ", ".join(f"{x:.1f}" for x in seconds)
        lines.append(f"| {name} | {runs} | {size_mb / best:.2f} | {docs / best:.0f} |")
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
