"""Tokenizers behind one small interface, chosen by Megatron's `--tokenizer-type`.

Every tokenizer has `vocab_size`, `eod` (the id appended by `--append-eod` and used by the
dataset's EOD masks), `tokenize(text) -> list[int]` and `detokenize(ids) -> str`. Ids match
Megatron's tokenizer of the same type on the same files:

- GPT2BPETokenizer: vocab.json + merges.txt, byte-level BPE with the GPT-2 split regex (run by the
  Rust `tokenizers` package); eod = `<|endoftext|>`.
- HuggingFaceTokenizer: a local tokenizer.json, or a directory holding one (plus, optionally,
  tokenizer_config.json naming the EOS token); special tokens added as transformers adds them.
- SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer: a .model file.
- TikTokenizer: a local .tiktoken file (base64 token and rank per line) or Megatron's JSON vocab.
- NullTokenizer: the text is whitespace-separated integer ids (already tokenized data).
- ByteLevelTokenizer: UTF-8 bytes are the ids.
- BertWordPieceLowerCase / BertWordPieceCase: a BERT vocab.txt (paratron/data/wordpiece.py).

Nothing here touches the network: every path must be a local file.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from paratron.config.values import TOKENIZER_TYPES
from paratron.data.errors import DataError

TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")  # what chat templates may name


def _need_package(name: str, kind: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(f"--tokenizer-type {kind} needs the {name} package: pip install {name}")


def _need_file(path: Optional[str], flag: str, kind: str) -> str:
    if not path:
        raise DataError(f"--tokenizer-type {kind} needs {flag}")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: no such file")
    return str(path)


class Tokenizer:
    """The interface. Subclasses set `_vocab_size` and `_eod` (and `_pad` when they have one)."""

    _vocab_size: int = 0
    _eod: Optional[int] = None
    _pad: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> Optional[int]:
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        return self._pad

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    # ---- what fill-in-the-middle samples need (data/fim.py); only tokenizers with special tokens have it
    def token_id(self, token: str) -> Optional[int]:
        """The id of ``token`` when the vocabulary has it as one (special) token, else None."""
        return None

    def text_of(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` without special tokens (FIM cuts it at character positions)."""
        raise NotImplementedError(f"{type(self).__name__} has no special tokens")

    def ids_of(self, text: str) -> List[int]:
        """``text``'s ids without the special tokens a tokenizer may add (BOS)."""
        raise NotImplementedError(f"{type(self).__name__} has no special tokens")

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        """What identifies this tokenizer in a dataset cache description."""
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}


class _HFBased(Tokenizer):
    """Shared code of the tokenizers run by the Rust `tokenizers` package."""

    def __init__(self, tok, add_special_tokens: bool, skip_special_in_text: bool = False):
        self._tok = tok
        self._add_special = add_special_tokens
        self._skip_special_in_text = skip_special_in_text
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=self._add_special)
        return [e.ids for e in encs]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=self._skip_special_in_text)

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def text_of(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def ids_of(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


class GPT2BPETokenizer(_HFBased):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

        try:
            vocab, merges = models.BPE.read_file(vocab_file, merge_file)
        except Exception as err:  # the Rust reader's message names the bad part
            raise DataError(f"--vocab-file/--merge-file {vocab_file}, {merge_file}: {err}")
        tok = RustTokenizer(models.BPE(vocab, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        super().__init__(tok, add_special_tokens=False)
        self._vocab_size = len(vocab)
        if "<|endoftext|>" not in vocab:
            raise DataError(f"--vocab-file {vocab_file}: has no <|endoftext|> token (the EOD)")
        self._eod = vocab["<|endoftext|>"]


def _token_content(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(_HFBased):
    """A ``tokenizer.json`` (local). ``include_special_tokens`` (Megatron's; False with
    ``--tokenizer-hf-no-include-special-tokens``): the text's ids get the special tokens the
    tokenizer's template adds (a BOS, say), and decoding keeps special tokens; False: neither."""

    def __init__(self, path: str, include_special_tokens: bool = True):
        from tokenizers import Tokenizer as RustTokenizer

        if os.path.isdir(path):
            folder, file = path, os.path.join(path, "tokenizer.json")
        else:
            folder, file = os.path.dirname(os.path.abspath(path)), path
        if not os.path.isfile(file):
            raise DataError(f"--tokenizer-model {path}: no tokenizer.json there (only local files)")
        try:
            tok = RustTokenizer.from_file(file)
        except Exception as err:
            raise DataError(f"--tokenizer-model {file}: not a tokenizers JSON file ({err})")
        super().__init__(tok, add_special_tokens=include_special_tokens,
                         skip_special_in_text=not include_special_tokens)
        config: Dict[str, object] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            extra = os.path.join(folder, name)
            if os.path.isfile(extra):
                with open(extra, encoding="utf-8") as f:
                    config.update(json.load(f))
        self._eod = self._lookup(_token_content(config.get("eos_token")))
        if self._eod is None:
            for cand in EOS_CANDIDATES:
                if tok.token_to_id(cand) is not None:
                    self._eod = tok.token_to_id(cand)
                    break
        self._pad = self._lookup(_token_content(config.get("pad_token")))
        template = config.get("chat_template")
        self.chat_template: Optional[str] = template if isinstance(template, str) else None
        self._special_texts = {k: v for k in SPECIAL_NAMES if (v := _token_content(config.get(k))) is not None}

    def special_texts(self) -> Dict[str, str]:
        """The special tokens' texts a chat template may name (bos_token, eos_token, unk_token, pad_token)."""
        return dict(self._special_texts)

    def _lookup(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)


class _SentencePieceBase(Tokenizer):
    def __init__(self, model_file: str):
        sentencepiece = _need_package("sentencepiece", type(self).__name__)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except Exception as err:
            raise DataError(f"--tokenizer-model {model_file}: not a SentencePiece model ({err})")
        self._vocab_size = len(self._sp)

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """The model's own pieces; eod = the model's EOS."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self._eod = self._sp.eos_id()
        self._pad = self._sp.pad_id()


class Llama2Tokenizer(_SentencePieceBase):
    """The model's pieces with BOS prepended to every text; eod = EOS."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self._bos = self._sp.bos_id()
        self._eod = self._sp.eos_id()

    def tokenize(self, text: str) -> List[int]:
        return [self._bos] + self._sp.encode(text)


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron's generic SentencePiece wrapper: it appends <CLS>, <SEP>, <EOD>, <MASK> (and PAD,
    BOS, EOS and <extra_id_i> when the model lacks them) after the model's pieces; those strings in
    the text become their ids. eod = <EOD>."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file)
        sp = self._sp
        self._vocab = {sp.id_to_piece(i): i for i in range(len(sp))}
        self._special: Dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        for token in ("<CLS>", "<SEP>"):
            add(token)
        self._eod = add("<EOD>")
        add("<MASK>")
        for getter, fallback in ((sp.pad_id, "<PAD>"), (sp.bos_id, "<BOS>"), (sp.eos_id, "<EOS>")):
            try:
                token = sp.id_to_piece(getter())
            except IndexError:
                token = fallback
            ident = add(token)
            if fallback == "<PAD>":
                self._pad = ident
        for i in range(vocab_extra_ids or 0):
            add(f"<extra_id_{i}>")
        self._vocab_size = len(self._vocab)
        self._inv_special = {v: k for k, v in self._special.items()}

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        pos = 0
        while True:
            hits = {}
            for token in self._special:
                at = text.find(token, pos)
                if at >= 0:
                    hits[token] = at
            if not hits:
                break
            token = min(hits, key=hits.get)  # the earliest; on a tie the first in order
            ids.extend(self._sp.encode_as_ids(text[pos : hits[token]]))
            ids.append(self._special[token])
            pos = hits[token] + len(token)
        ids.extend(self._sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        out, last = "", 0
        ids = [int(i) for i in ids]
        for i, ident in enumerate(ids):
            if ident in self._inv_special:
                out += self._sp.decode_ids(ids[last:i]) + " " + self._inv_special[ident] + " "
                last = i + 1
        return out + self._sp.decode_ids(ids[last:])


def load_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    """Mergeable ranks from a .tiktoken file ("<base64 token> <rank>" lines) or from Megatron's
    JSON vocabulary (a list of {"rank", "token_bytes", "token_str"})."""
    ranks: Dict[bytes, int] = {}
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                for item in json.load(f):
                    ranks[base64.b64decode(item["token_bytes"])] = int(item["rank"])
        else:
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"--tokenizer-model {path}: not a tiktoken vocabulary ({err})")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"--tokenizer-model {path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


class TikTokenizer(Tokenizer):
    """tiktoken BPE with Megatron's layout: `num_special_tokens` reserved ids first (<unk>, <s>,
    </s>, then <SPECIAL_i> fillers), the file's ranks shifted after them; eod = </s>."""

    def __init__(
        self, path: str, pattern: str = "v2", vocab_size: Optional[int] = None,
        num_special_tokens: int = 1000, special_tokens: Optional[Sequence[str]] = None,
    ):
        tiktoken = _need_package("tiktoken", "TikTokenizer")
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"--tiktoken-pattern {pattern!r}: choose v1 or v2")
        specials = list(special_tokens or ["<unk>", "<s>", "</s>"])
        for needed in ("<unk>", "<s>", "</s>"):
            if needed not in specials:
                raise DataError(f"--tokenizer-special-tokens must include {needed}")
        if len(specials) > num_special_tokens:
            raise DataError(f"{len(specials)} special tokens > --tiktoken-num-special-tokens")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        ranks = load_tiktoken_ranks(path)
        inner = len(ranks) if vocab_size is None else vocab_size - num_special_tokens
        inner = min(inner, 2**17 - num_special_tokens) if vocab_size is None else inner
        if inner > len(ranks) or inner <= 0:
            raise DataError(
                f"--vocab-size {vocab_size}: {path} has {len(ranks)} tokens, needs "
                f"{inner} after {num_special_tokens} special ones"
            )
        shifted = {tok: r + num_special_tokens for tok, r in ranks.items() if r < inner}
        special_ids = {tok: i for i, tok in enumerate(specials)}
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=shifted, special_tokens=special_ids,
        )
        self._vocab_size = num_special_tokens + inner
        self._eod = special_ids["</s>"]

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids. vocab = --vocab-size; eod =
    --null-tokenizer-eod-id, by default vocab_size - 1."""

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None):
        if not vocab_size or vocab_size < 1:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size")
        self._vocab_size = int(vocab_size)
        self._eod = int(eod_id) if eod_id is not None else self._vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        ids = [int(x) for x in text.split()]
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self._vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class ByteLevelTokenizer(Tokenizer):
    """Ids are the UTF-8 bytes of the text; eod defaults to 256, vocab to 257."""

    def __init__(self, vocab_size: Optional[int] = None, eod_id: Optional[int] = None):
        self._eod = 256 if eod_id is None else int(eod_id)
        self._vocab_size = int(vocab_size) if vocab_size else max(257, self._eod + 1)
        if self._vocab_size < 256 or self._eod >= self._vocab_size:
            raise DataError(f"ByteLevelTokenizer: vocab {self._vocab_size} / eod {self._eod} bad")

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def build_tokenizer(data) -> Tokenizer:
    """The tokenizer that the tokenizer flags of ``data`` (a :class:`paratron.config.DataConfig`; the
    fields of ``paratron.config.TOKENIZER_FIELDS``) name. ``paratron train`` and ``paratron
    preprocess`` both build theirs here, from the same flags."""
    kind = data.tokenizer_type
    if kind == "GPT2BPETokenizer":
        vocab = _need_file(data.vocab_file, "--vocab-file", kind)
        merges = _need_file(data.merge_file, "--merge-file", kind)
        return GPT2BPETokenizer(vocab, merges)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_file(data.tokenizer_model, "--tokenizer-model", kind),
                                    not getattr(data, "tokenizer_hf_no_include_special_tokens", False))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        model = _need_file(data.tokenizer_model, "--tokenizer-model", kind)
        if kind == "SentencePieceTokenizer":
            return SentencePieceTokenizer(model, data.vocab_extra_ids or 0)
        return GPTSentencePieceTokenizer(model) if kind[0] == "G" else Llama2Tokenizer(model)
    if kind == "TikTokenizer":
        return TikTokenizer(
            _need_file(data.tokenizer_model, "--tokenizer-model", kind),
            pattern=data.tiktoken_pattern or "v2",
            vocab_size=data.vocab_size,
            num_special_tokens=data.tiktoken_num_special_tokens or 1000,
            special_tokens=data.tokenizer_special_tokens,
        )
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from paratron.data.wordpiece import BertWordPieceTokenizer
        return BertWordPieceTokenizer(_need_file(data.vocab_file, "--vocab-file", kind), kind.endswith("LowerCase"),
                                      data.vocab_extra_ids or 0)
    if kind == "NullTokenizer":
        return NullTokenizer(data.vocab_size, data.null_tokenizer_eod_id)
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer(data.vocab_size, data.null_tokenizer_eod_id)
    raise DataError(
        f"--tokenizer-type {kind}: not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def tokenizer_vocab_size(data) -> int:
    """The vocabulary size of the tokenizer ``data`` names (``resolve()`` stores it in the config)."""
    return build_tokenizer(data).vocab_size


# Training lives in its own module; re-exported here so one import finds every tokenizer tool.
from paratron.data.bpe_train import tokenizer_train_main, train_bpe_tokenizer  # noqa: E402,F401
