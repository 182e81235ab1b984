"""A tiny T5 (and a GPT of the same width and depth) trained on real English text on the CPU: the loss curves.

    python benchmarks/t5_loss_curve.py [--iters 200] [--out benchmarks/results/t5_loss_curve_cpu_YYYYMMDD.md]

The text: the docstrings of the running Python's standard library (English prose, on every machine with Python),
one document per docstring, split into sentences by ``paratron preprocess --split-sentences``. A WordPiece
vocabulary is trained on it (``tokenizers``). T5 v1.1 style (relative buckets, RMSNorm, gated GeLU, no biases,
untied head) runs ``pretrain_t5.py`` on the span-corruption samples (``--vocab-extra-ids 100``); the GPT runs
``pretrain_gpt.py`` on the same documents (not split) with the same tokenizer. The record has both loss curves
(T5: the loss of the masked spans; GPT: next-token loss; they are different tasks) and the command lines.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+) \|")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def docstrings(limit: int) -> list[str]:
    """Docstrings of at least 200 characters from the standard library's modules, in file order."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append(" ".join(doc.split()))
        if len(out) >= limit:
            break
    return out[:limit]


def prepare(work: Path, docs: int) -> tuple[str, str, str, int]:
    """(sentence-level prefix, document-level prefix, vocab.txt, number of documents)."""
    from tokenizers import BertWordPieceTokenizer

    texts = docstrings(docs)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=2000, min_frequency=2, special_tokens=SPECIALS)
    vocab = work / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])))
    from paratron.data.preprocess import main
    base = ["--input", str(corpus), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab),
            "--workers", "1", "--no-progress"]
    assert main(base + ["--output-prefix", str(work / "s"), "--split-sentences"]) == 0
    assert main(base + ["--output-prefix", str(work / "d")]) == 0
    return str(work / "s_text_sentence"), str(work / "d_text_document"), str(vocab), len(texts)


def common(iters: int, vocab: str, cache: str) -> list[str]:
    return ["--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--micro-batch-size",
            "8", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3", "--lr-decay-style",
            "cosine", "--lr-warmup-iters", "10", "--min-lr", "1e-4", "--weight-decay", "0.01", "--clip-grad", "1.0",
            "--log-interval", "10", "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--vocab-file", vocab, "--tokenizer-type", "BertWordPieceLowerCase",
            "--split", "1000,0,0", "--data-cache-path", cache, "--device", "cpu", "--seed", "1234"]


def run(script: str, flags: list[str]) -> list[tuple[int, float]]:
    r = subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
    if r.returncode:
        raise SystemExit(f"{script} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return [(int(i), float(x)) for i, x in LOSS.findall(r.stdout)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="t5curve"))
    sentences, documents, vocab, n_docs = prepare(work, args.docs)
    base = common(args.iters, vocab, str(work / "cache"))
    t5_flags = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--kv-channels", "32", "--encoder-seq-length",
                "128", "--decoder-seq-length", "64", "--max-position-embeddings", "128", "--position-embedding-type",
                "relative", "--normalization", "RMSNorm", "--geglu", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights", "--vocab-extra-ids", "100", "--data-path", sentences, *base]
    gpt_flags = ["--num-layers", "4", "--seq-length", "128", "--max-position-embeddings", "128",
                 "--data-path", documents, *base]
    t5, gpt = run("pretrain_t5.py", t5_flags), run("pretrain_gpt.py", gpt_flags)
    lines = [f"# T5 and GPT loss curves on real text, CPU ({datetime.date.today():%Y-%m-%d})", "",
             f"`python benchmarks/t5_loss_curve.py --iters {args.iters} --docs {args.docs}` (torch {_torch()}, "
             f"Python {sys.version.split()[0]}): {n_docs} standard-library docstrings, WordPiece vocabulary of "
             "2000 trained on them. T5: 2 encoder + 2 decoder layers (the GPT: 4), hidden 128, 4 heads, FFN 256, "
             "batch 8, 128 encoder tokens / 64 decoder tokens (GPT: 128), AdamW 1e-3 cosine to 1e-4. T5's loss is "
             "over the masked spans and sentinels, the GPT's over every next token: the curves show each model "
             "learning, they are not the same task.", "", "| iteration | T5 lm loss | GPT lm loss |", "|---|---|---|"]
    g = dict(gpt)
    lines += [f"| {i} | {x:.4f} | {g.get(i, float('nan')):.4f} |" for i, x in t5]
    lines += ["", "T5 command: `python pretrain_t5.py " + " ".join(t5_flags).replace(str(work), "$WORK") + "`", "",
              "GPT command: `python pretrain_gpt.py " + " ".join(gpt_flags).replace(str(work), "$WORK") + "`", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _torch() -> str:
    import torch
    return torch.__version__


if __name__ == "__main__":
    main()
