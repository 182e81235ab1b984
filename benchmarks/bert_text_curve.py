"""A tiny BERT and a GPT of the same size on the same real English text, on CPU: their loss curves.

    python benchmarks/bert_text_curve.py [--iters 300] [--out benchmarks/results]

The text is the docstrings of the running Python's standard library (English prose, nothing downloaded),
one document per module. A WordPiece vocabulary (4,000 tokens) is trained on it with the ``tokenizers``
package; ``paratron preprocess --split-sentences`` makes the BERT data (one sequence per sentence) and a plain
``--append-eod`` run the GPT data, both with ``BertWordPieceLowerCase``. Both models: 2 layers, hidden 64,
4 heads, sequence 64, batch 16, lr 1e-3 with 10 % linear warm-up then cosine decay, the same seed. BERT is
``pretrain_bert.py`` (masked-LM loss over the 15 % masked tokens, plus the sentence-order loss in the backward
that the log line does not show); GPT is ``pretrain_gpt.py`` (next-token loss over every token). The record
lists both curves (train loss every 10 iterations, validation at the end).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.record import write_record  # noqa: E402

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
VALID = re.compile(r"validation loss at iteration\s+(\d+) \| lm loss value: ([0-9.E+-]+)")


def docstring_corpus(out: Path) -> int:
    """One JSON line per stdlib module: its docstrings, whitespace-joined; returns the document count."""
    from paratron.data.corpus import stdlib_source_files
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for _, path in stdlib_source_files():
            try:
                tree = ast.parse(Path(path).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            docs = [ast.get_docstring(node) for node in ast.walk(tree)
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            text = " ".join(" ".join(d.split()) for d in docs if d and len(d.split()) > 4)
            if text.count(". ") >= 2:
                f.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


def vocab(corpus: Path, out: Path, size: int = 4000) -> None:
    from tokenizers import BertWordPieceTokenizer
    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    out.write_text("".join(t + "\n" for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])))


def run(cmd: list[str]) -> str:
    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:2])} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def train(script: str, data: str, voc: str, iters: int, tmp: Path) -> tuple[dict, dict]:
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "16", "--global-batch-size", "16",
             "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
             "--lr-warmup-fraction", "0.1", "--log-interval", "10", "--eval-interval", str(iters),
             "--eval-iters", "10", "--seed", "1234", "--num-workers", "0", "--device", "cpu",
             "--data-path", data, "--vocab-file", voc, "--tokenizer-type", "BertWordPieceLowerCase",
             "--split", "95,5,0", "--data-cache-path", str(tmp / "cache")]
    out = run([script, *model])
    return ({int(i): float(v) for i, v in LOSS.findall(out)}, {int(i): float(v) for i, v in VALID.findall(out)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bert-curve-") as d:
        tmp = Path(d)
        docs = docstring_corpus(tmp / "corpus.jsonl")
        vocab(tmp / "corpus.jsonl", tmp / "vocab.txt")
        common = ["--input", str(tmp / "corpus.jsonl"), "--tokenizer-type", "BertWordPieceLowerCase",
                  "--vocab-file", str(tmp / "vocab.txt"), "--workers", "1", "--no-progress"]
        run(["tools/preprocess_data.py", *common, "--output-prefix", str(tmp / "bert"), "--split-sentences"])
        run(["tools/preprocess_data.py", *common, "--output-prefix", str(tmp / "gpt"), "--append-eod"])
        voc = str(tmp / "vocab.txt")
        bert = train("pretrain_bert.py", str(tmp / "bert_text_sentence"), voc, args.iters, tmp)
        gpt = train("pretrain_gpt.py", str(tmp / "gpt_text_document"), voc, args.iters, tmp)
    rows = ["| iteration | BERT masked-LM loss | GPT next-token loss |", "|---|---|---|"]
    rows += [f"| {i} | {bert[0].get(i, float('nan')):.4f} | {gpt[0].get(i, float('nan')):.4f} |"
             for i in sorted(set(bert[0]) | set(gpt[0]))]
    first = min(bert[0])
    body = "\n".join(rows) + "\n\n" + (
        f"Validation loss at iteration {args.iters}: BERT {bert[1].get(args.iters, float('nan')):.4f}, "
        f"GPT {gpt[1].get(args.iters, float('nan')):.4f}. From iteration {first} to {args.iters} the BERT loss "
        f"fell by {bert[0][first] - bert[0][args.iters]:.3f} nats, the GPT loss by "
        f"{gpt[0][first] - gpt[0][args.iters]:.3f} nats (different objectives over the same text and steps: "
        "masked tokens with both-side context vs every next token).")
    write_record(args.out, "bert_text_curve_cpu", "A tiny BERT and a same-size GPT on stdlib docstrings (CPU)",
                 f"CPU ({os.cpu_count()} cores, shared)", {"corpus": f"{docs} documents of stdlib docstrings",
                                                           "iterations": str(args.iters)}, body)


if __name__ == "__main__":
    main()
