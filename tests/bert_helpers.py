"""Small BERT data made inside the tests: a corpus of capitalised sentences, a WordPiece vocab.txt trained on
it, and its sentence-level .bin/.idx (paratron preprocess --split-sentences)."""
from __future__ import annotations

import os
import random

from data_helpers import WORDS, write_jsonl

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


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
    """vocab.txt (one token a line) of a WordPiece model trained on the corpus; small enough for ``##`` pieces."""
    import json

    from tokenizers import BertWordPieceTokenizer

    texts = [json.loads(line)["text"] for line in open(corpus_jsonl, encoding="utf-8")]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1, special_tokens=BERT_SPECIALS,
                            limit_alphabet=200)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    path = os.path.join(str(workdir), "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t, _ in vocab))
    return path


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
