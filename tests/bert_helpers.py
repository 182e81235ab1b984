"""Small BERT data made inside the tests: a corpus of capitalised sentences, a WordPiece vocab.txt trained on
it, and its sentence-level .bin/.idx (paratron preprocess --split-sentences)."""
from __future__ import annotations

import os
import random

from data_helpers import WORDS, write_jsonl

def bert_corpus(path, docs: int = 120, seed: int = 0) -> str:
    rng = random.Random(seed)
    texts = []
    for _ in range(docs):
        sentences = []
        for _ in range(rng.randint(1, 7)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 14))]
            sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + rng.choice([".", "!", "?"]))
        texts.append(" ".join(sentences))
    return write_jsonl(path, texts)


def train_wordpiece_vocab(workdir, corpus_jsonl: str, vocab_size: int = 160) -> str:
    """vocab.txt of a WordPiece model trained on the corpus; small enough for ``##`` pieces."""
    import json

    from paratron.data.wordpiece import train_wordpiece_vocab as train

    texts = [json.loads(line)["text"] for line in open(corpus_jsonl, encoding="utf-8")]
    return train(texts, os.path.join(str(workdir), "vocab.txt"), vocab_size)


def bert_data(workdir, docs: int = 120, vocab_size: int = 160):
    """(prefix of the sentence-level dataset, vocab.txt) in ``workdir``."""
    from paratron.data.preprocess import main

    corpus = bert_corpus(os.path.join(str(workdir), "corpus.jsonl"), docs)
    vocab = train_wordpiece_vocab(workdir, corpus, vocab_size)
    prefix = os.path.join(str(workdir), "bert")
    rc = main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "BertWordPieceLowerCase",
               "--vocab-file", vocab, "--split-sentences", "--workers", "1", "--no-progress"])
    assert rc == 0
    return prefix + "_text_sentence", vocab
