"""Small data made inside the tests: corpora, tokenizer files, indexed datasets."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import subprocess
import sys
import types
import warnings
from collections import OrderedDict

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "data model train token batch layer python value error return import class def self print "
    "café naïve über 東京 123 4567 2024 don't it's we're"
).split()


def sentence(rng: random.Random, n: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path, texts, key="text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def small_corpus(path, docs: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    texts = [". ".join(sentence(rng, rng.randint(3, 20)) for _ in range(rng.randint(1, 6)))
             for _ in range(docs)]
    return write_jsonl(path, texts)


def train_tiny_bpe(workdir, vocab_size: int = 400) -> str:
    """tokenizer.json plus vocab.json + merges.txt in `workdir`; returns the tokenizer.json path."""
    from paratron.data.bpe_train import export_gpt2_files, train_bpe_tokenizer

    corpus = small_corpus(os.path.join(workdir, "bpe_corpus.jsonl"), 400)
    path = train_bpe_tokenizer([corpus], vocab_size, os.path.join(workdir, "tokenizer.json"))
    export_gpt2_files(path, str(workdir))
    return path


def train_tiny_sentencepiece(path, vocab_size: int = 100) -> str:
    import sentencepiece as spm

    rng = random.Random(1)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([sentence(rng, 15) for _ in range(600)]), model_writer=model,
        vocab_size=vocab_size, minloglevel=2,
    )
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return str(path)


def tiny_tiktoken_ranks():
    """256 single bytes plus a few merges, as tiktoken mergeable ranks."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"he", b"the", b" t", b" the", b"in", b"an", b"er", b"at", b" a"):
        ranks[merge] = len(ranks)
    return ranks


def write_tiktoken_file(path) -> str:
    with open(path, "wb") as f:
        for token, rank in tiny_tiktoken_ranks().items():
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return str(path)


def write_tiktoken_json(path) -> str:
    items = [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode(
        "utf-8", errors="replace")} for t, r in tiny_tiktoken_ranks().items()]
    with open(path, "w") as f:
        json.dump(items, f)
    return str(path)


def random_documents(n: int, seed: int = 0, vocab: int = 500, max_len: int = 300):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n)]


class StubTokenizer:
    """Just what the datasets need (and what megatron-core's datasets ask of a tokenizer)."""

    def __init__(self, vocab_size: int = 500, eod: int = 499):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = OrderedDict({"class": "StubTokenizer"})


def data_args(**kw):
    """A paratron Config (unresolved: the data builders only read it) with these Megatron settings."""
    from paratron.config import Config

    base = dict(split="90,8,2", seq_length=32, seed=1234, train_iters=20, train_samples=None,
                global_batch_size=8, eval_interval=10, eval_iters=2, data_cache_path=None,
                mock_data=False, reset_position_ids=False, reset_attention_mask=False,
                eod_mask_loss=False, data_path=None, train_data_path=None, valid_data_path=None,
                test_data_path=None)
    base.update(kw)
    cfg = Config()
    for name, value in base.items():
        cfg.set(name, value)
    return cfg


def build_datasets(cfg, tokenizer, **kw):
    """paratron's dataset builder on the sections of `cfg`, as the Trainer calls it."""
    from paratron.data.blended import build_train_valid_test_datasets, train_valid_test_num_samples

    return build_train_valid_test_datasets(cfg.data, tokenizer, cfg.model.seq_length, cfg.train.seed,
                                           train_valid_test_num_samples(cfg.train), **kw)


def import_mcore_datasets():
    """megatron-core's dataset modules, or None when it cannot be imported here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import gpt_dataset, indexed_dataset
            from megatron.core.datasets.blended_megatron_dataset_builder import (
                BlendedMegatronDatasetBuilder,
            )
    except Exception:  # not installed, or a dependency missing
        return None
    return types.SimpleNamespace(gpt=gpt_dataset, indexed=indexed_dataset,
                                 Builder=BlendedMegatronDatasetBuilder)


def run_cli(args, cwd=None, module="tools/preprocess_data.py"):
    """Run a command-line tool of this repo in a fresh interpreter; returns CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, os.path.join(REPO, module), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
