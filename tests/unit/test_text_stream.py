"""The server's streamed text (inference/server.TextStream): each token decodes only a window after the text
already final, and the deltas it sends add up to the whole row's decode for byte-level BPE (characters split
over tokens), SentencePiece (pieces joined with their leading spaces) and the byte-level tokenizer; stop strings
cut as in the whole text; nothing sent ends in a replacement character."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import train_tiny_bpe, train_tiny_sentencepiece  # noqa: E402

from paratron.config import DataConfig  # noqa: E402
from paratron.data.tokenizers import build_tokenizer  # noqa: E402
from paratron.inference.server import TextStream  # noqa: E402

TEXT = "the model's data, café naïve über 東京 🙂 and  two  spaces\nnew line: def f(x): return x"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    work = tmp_path_factory.mktemp("tok")
    bpe = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=train_tiny_bpe(str(work))))
    sp = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer",
                                    tokenizer_model=train_tiny_sentencepiece(work / "sp.model")))
    byte = build_tokenizer(DataConfig(tokenizer_type="ByteLevelTokenizer"))
    return {"bpe": bpe, "sentencepiece": sp, "bytes": byte}


class Counting:
    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def __call__(self, ids):
        self.decoded += len(ids)
        return self.tok.detokenize(ids)


@pytest.mark.parametrize("name", ["bpe", "sentencepiece", "bytes"])
def test_streamed_deltas_add_up_to_the_whole_decode(tokenizers, name):
    tok = tokenizers[name]
    ids = tok.tokenize(TEXT)
    decode = Counting(tok)
    stream = TextStream(decode, ())
    deltas = [stream.push(t) for t in ids]
    whole = tok.detokenize(ids)
    assert "".join(deltas) + stream.rest(whole) == whole
    assert not any(d.endswith("\ufffd") for d in deltas)
    assert decode.decoded < 8 * len(ids)  # a window per token, not the whole row (len(ids)^2 / 2 tokens)


def test_a_stop_string_cuts_the_stream_where_the_whole_text_does(tokenizers):
    tok = tokenizers["bpe"]
    ids = tok.tokenize(TEXT)
    stream = TextStream(tok.detokenize, ("über",))
    sent = "".join(stream.push(t) for t in ids)
    assert sent == TEXT[:TEXT.index("über")]


@pytest.mark.parametrize("name", ["bpe", "sentencepiece", "bytes"])
def test_a_chunk_of_several_tokens_sends_what_token_by_token_sends(tokenizers, name):
    """A chunk carrying the tokens of several steps (the response fell behind the engine) sends the token-by-token
    deltas joined, stop strings and characters split over tokens included."""
    tok = tokenizers[name]
    ids = tok.tokenize(TEXT)
    one, many = TextStream(tok.detokenize, ("über",)), TextStream(tok.detokenize, ("über",))
    for at in range(0, len(ids), 5):
        chunk = ids[at:at + 5]
        assert many.push_all(chunk + [None]) == "".join(one.push(t) for t in chunk)
    whole = tok.detokenize(ids)
    assert many.sent == one.sent == whole[:whole.index("über")]


def test_a_chunk_is_decoded_once_not_twice_per_token(tokenizers):
    """Two decoder calls (the window and its context) for a chunk of 8 tokens, not 16."""
    tok = tokenizers["bpe"]
    ids = tok.tokenize(TEXT)
    calls = []
    stream = TextStream(lambda x: calls.append(1) or tok.detokenize(x), ())
    stream.push(ids[0])
    calls.clear()
    stream.push_all(ids[1:9])
    assert len(calls) == 2
    assert stream.push_all([None]) == "" and len(calls) == 2
