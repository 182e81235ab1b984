"""BERT's WordPiece tokenizers (Megatron's ``--tokenizer-type BertWordPieceLowerCase | BertWordPieceCase`` with
``--vocab-file vocab.txt``, one token per line, the id its line number), run by the Rust ``tokenizers``
package's BERT pipeline (normaliser: lower-casing and accent stripping for LowerCase, CJK spacing; punctuation
and whitespace split; greedy longest-match WordPiece with ``##`` continuations).

Besides the interface of paratron/data/tokenizers.py a WordPiece tokenizer has what BERT's data needs:
``cls`` / ``sep`` / ``mask`` / ``pad`` ids ([CLS], [SEP], [MASK], [PAD]), ``eod`` = [SEP] (Megatron's),
``continues(id)`` (a ``##`` piece: whole-word masking) and ``inv_vocab`` (id -> token, in id order).
Ids of text are without [CLS] / [SEP]: the datasets add them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from paratron.data.errors import DataError
from paratron.data.tokenizers import _HFBased

SPECIALS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")


def read_vocab(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        tokens = [line.rstrip("\n").rstrip("\r") for line in f]
    while tokens and tokens[-1] == "":
        tokens.pop()
    return tokens


class BertWordPieceTokenizer(_HFBased):
    """``vocab_extra_ids`` N > 0 (``--vocab-extra-ids``, T5): [BOS], [EOS] and the sentinels <extra_id_0> ..
    <extra_id_N-1> are appended to the vocabulary where it lacks them (Megatron's BERT WordPiece tokenizer's
    additions), each one token in text."""

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0):
        from tokenizers import BertWordPieceTokenizer as Impl

        tokens = read_vocab(vocab_file)
        added = ["[BOS]", "[EOS]", *(f"<extra_id_{i}>" for i in range(vocab_extra_ids))] if vocab_extra_ids else []
        tokens += [t for t in added if t not in tokens]
        missing = [t for t in SPECIALS if t not in tokens]
        if missing:
            raise DataError(f"--vocab-file {vocab_file}: a BERT vocabulary needs {', '.join(missing)}")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise DataError(f"--vocab-file {vocab_file}: a token appears on two lines")
        tok = Impl(vocab, lowercase=lower_case, strip_accents=lower_case, clean_text=True,
                   handle_chinese_chars=True, wordpieces_prefix="##")
        if added:
            tok.add_special_tokens(added)
        super().__init__(tok, add_special_tokens=False, skip_special_in_text=True)
        self.bos, self.eos = (vocab[t] if t in vocab else None for t in ("[BOS]", "[EOS]"))
        self.lower_case, self._tokens = lower_case, tokens
        self.cls, self.sep, self.mask, self._pad = (vocab[t] for t in SPECIALS[:4])
        self._eod = self.sep

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return dict(enumerate(self._tokens))

    def continues(self, token_id: int) -> bool:
        """Whether the token continues a word (a WordPiece ``##`` piece)."""
        return self._tokens[int(token_id)].startswith("##")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "lower_case": self.lower_case}


def train_wordpiece_vocab(texts, out_path: str, vocab_size: int, lower_case: bool = True) -> str:
    """Train a WordPiece vocabulary on ``texts`` (the ``tokenizers`` package's BERT trainer) and write it as a
    BERT vocab.txt (the special tokens first: [PAD] [UNK] [CLS] [SEP] [MASK]); returns ``out_path``."""
    from tokenizers import BertWordPieceTokenizer as Impl

    tok = Impl(lowercase=lower_case, strip_accents=lower_case)
    tok.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=1, limit_alphabet=200,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    ordered = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t, _ in ordered))
    return out_path
