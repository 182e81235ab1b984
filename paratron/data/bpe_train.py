"""Train a byte-level BPE tokenizer (GPT-2 style) with the `tokenizers` package.

`paratron tokenizer train --input FILES --vocab-size N --output tokenizer.json` calls
`tokenizer_train_main`. The result loads with `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model tokenizer.json`; `export_gpt2_files` also writes vocab.json + merges.txt for
`--tokenizer-type GPT2BPETokenizer`.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys
from typing import Iterable, Iterator, List, Sequence

from paratron.data.errors import DataError
from paratron.errors import ArgumentParser, run_command

EOD_TOKEN = "<|endoftext|>"


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _is_jsonl(path: str) -> bool:
    base = path[:-3] if path.endswith(".gz") else path
    return base.endswith((".jsonl", ".json"))


def iter_training_texts(files: Sequence[str], text_key: str = "text") -> Iterator[str]:
    """Texts of JSONL files (their `text_key` field; bad lines skipped) or lines of text files."""
    for path in files:
        with _open_text(path) as f:
            if _is_jsonl(path):
                for line in f:
                    try:
                        value = json.loads(line).get(text_key)
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(value, str) and value:
                        yield value
            else:
                for line in f:
                    yield line


def expand_inputs(patterns: Iterable[str]) -> List[str]:
    """Input paths, with shell globs expanded and sorted; a pattern matching nothing is an error."""
    files: List[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataError(f"--input {pattern}: no such file")
        files.extend(matches)
    return files


def train_bpe_tokenizer(
    files: Sequence[str], vocab_size: int, out_path: str, text_key: str = "text",
    min_frequency: int = 2, special_tokens: Sequence[str] = (EOD_TOKEN,),
) -> str:
    """Train a byte-level BPE on `files` (JSONL with `text_key`, or plain text) and save it as a
    tokenizers JSON file at `out_path` (written whole, then renamed). Returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens):
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least "
                        f"{256 + len(special_tokens)} (256 bytes + special tokens)")
    files = expand_inputs(files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(iter_training_texts(files, text_key), trainer=trainer)
    if os.path.isdir(out_path) or not str(out_path).endswith(".json"):  # a directory
        out_path = os.path.join(out_path, "tokenizer.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, out_path)
    return out_path


def vocabulary_report(tokenizer_json: str, asked: int, min_frequency: int) -> str:
    """What a BPE training produced against the --vocab-size asked for (fewer when the corpus has no
    more pairs seen --min-frequency times)."""
    import json

    with open(tokenizer_json, encoding="utf-8") as f:
        spec = json.load(f)
    merges = len(spec["model"]["merges"])
    size = len(set(spec["model"]["vocab"]) | {t["content"] for t in spec.get("added_tokens", [])})
    if size >= asked:
        return f"{size} tokens ({merges} merges), as asked"
    return (f"{size} tokens, fewer than the {asked} asked for: the corpus yields only {max(merges, 0)} merges of "
            f"pairs seen at least {min_frequency} times (--min-frequency); use more text or a smaller --vocab-size")


def export_gpt2_files(tokenizer_json: str, out_dir: str) -> tuple:
    """Write vocab.json + merges.txt of a trained BPE; returns their paths."""
    from tokenizers import Tokenizer

    os.makedirs(out_dir, exist_ok=True)
    Tokenizer.from_file(tokenizer_json).model.save(out_dir)
    return os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")


def _tokenizer_train(argv) -> int:
    parser = ArgumentParser(
        prog="paratron tokenizer train", description="Train a byte-level BPE tokenizer.")
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL (.jsonl/.json[.gz], one object a line) or text files; globs ok")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, help="a .json file path, or a directory (gets tokenizer.json)")
    parser.add_argument("--json-key", default="text", help="text field of JSONL lines")
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--gpt2-files", action="store_true",
                        help="also write vocab.json and merges.txt next to the output")
    args = parser.parse_args(argv)
    path = train_bpe_tokenizer(args.input, args.vocab_size, args.output, args.json_key, args.min_frequency)
    if args.gpt2_files:
        export_gpt2_files(path, os.path.dirname(os.path.abspath(path)))
    print(f"wrote {path}: {vocabulary_report(path, args.vocab_size, args.min_frequency)}", file=sys.stderr)
    return 0


def tokenizer_train_main(argv=None) -> int:
    """`paratron tokenizer train`: 0 on success; 2 with one line on stderr for a user error."""
    return run_command("paratron tokenizer train", _tokenizer_train, sys.argv[1:] if argv is None else argv,
                       also=(OSError,))


if __name__ == "__main__":
    sys.exit(tokenizer_train_main())
