"""Each tokenizer type on tiny files made here, checked against the reference implementation."""

import json
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import (  # noqa: E402
    train_tiny_bpe, train_tiny_sentencepiece, tiny_tiktoken_ranks, write_jsonl,
    write_tiktoken_file, write_tiktoken_json,
)

from paratron.config import DataConfig  # noqa: E402
from paratron.data import DataError  # noqa: E402
from paratron.data.tokenizers import (  # noqa: E402
    ByteLevelTokenizer, NullTokenizer, build_tokenizer, tokenizer_train_main, train_bpe_tokenizer,
)

TEXTS = [
    "the model's data, it's 2024: café naïve über 東京!",
    "  leading spaces\n\nand blank lines\tand tabs  ",
    "def train(self):\n    return self.value  # comment",
    "",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("bpe")
    train_tiny_bpe(str(work))
    return work


def _args(**kw):
    return DataConfig(**kw)  # build_tokenizer takes the typed data section


def test_gpt2_bpe_matches_reference_gpt2_algorithm(bpe_dir):
    from transformers import GPT2Tokenizer  # the slow, pure-Python GPT-2 BPE, as in Megatron

    vocab, merges = str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")
    tok = build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                merge_file=merges))
    ref = GPT2Tokenizer(vocab, merges)
    assert tok.vocab_size == len(json.load(open(vocab))) == len(ref)
    assert tok.eod == ref.convert_tokens_to_ids("<|endoftext|>")
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == ref.encode(text)
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(TEXTS[0])) < len(TEXTS[0].encode())  # merges are applied


def test_huggingface_file_and_directory(bpe_dir, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = str(bpe_dir / "tokenizer.json")
    tok = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    ref = PreTrainedTokenizerFast(tokenizer_file=path)
    assert tok.vocab_size == len(ref)
    assert tok.eod == tok.tokenize("<|endoftext|>")[0]  # found by name, no config file
    for text in TEXTS:
        assert tok.tokenize(text) == ref(text).input_ids
        assert tok.detokenize(tok.tokenize(text)) == text
    # a directory with a config naming another EOS token
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "Ġthe", "tokenizer_class": "PreTrainedTokenizerFast"}))
    tok2 = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer",
                                 tokenizer_model=str(folder)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = AutoTokenizer.from_pretrained(str(folder))
    assert tok2.eod == auto.eos_token_id == tok.tokenize(" the")[0]
    assert tok2.tokenize(TEXTS[2]) == auto(TEXTS[2]).input_ids


def test_sentencepiece_family(tmp_path):
    import sentencepiece as spm

    model = train_tiny_sentencepiece(tmp_path / "sp.model")
    sp = spm.SentencePieceProcessor(model_file=model)
    text = TEXTS[0]

    gpt = build_tokenizer(_args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model))
    assert gpt.tokenize(text) == sp.encode_as_ids(text)
    assert (gpt.vocab_size, gpt.eod) == (len(sp), sp.eos_id())

    llama = build_tokenizer(_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=model))
    assert llama.tokenize(text) == [sp.bos_id()] + sp.encode(text)
    assert llama.eod == sp.eos_id()
    assert llama.detokenize(llama.tokenize("the data")) == "the data"

    # Megatron's generic wrapper appends <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has no
    # pad piece); BOS/EOS are the model's own pieces; extra ids come last.
    generic = build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer",
                                    tokenizer_model=model, vocab_extra_ids=2))
    n = len(sp)
    assert generic.vocab_size == n + 5 + 2
    assert generic.eod == n + 2
    assert generic.pad == n + 4
    ids = generic.tokenize("the data<EOD>model")
    assert ids == sp.encode_as_ids("the data") + [n + 2] + sp.encode_as_ids("model")
    assert generic.detokenize(ids).split() == ["the", "data", "<EOD>", "model"]


@pytest.mark.parametrize("kind", ["tiktoken", "json"])
def test_tiktoken(tmp_path, kind):
    import tiktoken

    path = (write_tiktoken_file(tmp_path / "v.tiktoken") if kind == "tiktoken"
            else write_tiktoken_json(tmp_path / "v.json"))
    tok = build_tokenizer(_args(tokenizer_type="TikTokenizer", tokenizer_model=path,
                                tiktoken_pattern="v2"))
    ranks = tiny_tiktoken_ranks()
    assert tok.vocab_size == 1000 + len(ranks)
    assert tok.eod == 2  # </s> after <unk>, <s>
    plain = tiktoken.Encoding("ref", pat_str=tok._enc._pat_str, mergeable_ranks=ranks,
                              special_tokens={})
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == [i + 1000 for i in plain.encode_ordinary(text)]
        assert tok.detokenize(ids) == text
    assert tok.tokenize(" the") == [1000 + ranks[b" the"]]


def test_tiktoken_matches_megatron_core(tmp_path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import (
                TikTokenTokenizer,
            )
    except Exception:
        pytest.skip("megatron-core tokenizers not importable")
    path = write_tiktoken_json(tmp_path / "v.json")
    size = 1000 + len(tiny_tiktoken_ranks())
    ref = TikTokenTokenizer(path, num_special_tokens=1000, vocab_size=size, pattern="v2")
    ours = build_tokenizer(_args(tokenizer_type="TikTokenizer", tokenizer_model=path,
                                 vocab_size=size))
    for text in TEXTS:
        assert ours.tokenize(text) == ref.text_to_ids(text)
    assert ours.eod == ref.eos_id


def test_null_and_byte_level():
    null = build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=100))
    assert (null.vocab_size, null.eod) == (100, 99)
    assert null.tokenize(" 5 17\n42 ") == [5, 17, 42]
    assert null.detokenize([5, 17]) == "5 17"
    with pytest.raises(ValueError):
        null.tokenize("5 100")
    assert NullTokenizer(100, eod_id=0).eod == 0
    byte = build_tokenizer(_args(tokenizer_type="ByteLevelTokenizer"))
    assert (byte.vocab_size, byte.eod) == (257, 256)
    assert byte.tokenize("é") == [0xC3, 0xA9]
    assert byte.detokenize(byte.tokenize(TEXTS[0]) + [256]) == TEXTS[0]
    assert ByteLevelTokenizer(vocab_size=512, eod_id=0).eod == 0


def test_factory_errors(tmp_path):
    cases = [
        (_args(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
        (_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "no.json"),
               merge_file="x"), "no such file"),
        (_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)),
         "no tokenizer.json"),
        (_args(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (_args(tokenizer_type="BertWordPieceCase"), "needs --vocab-file"),
        (_args(tokenizer_type="MultimodalTokenizer"), "not supported"),
        (_args(tokenizer_type="TikTokenizer", tokenizer_model=write_tiktoken_file(
            tmp_path / "t.tiktoken"), vocab_size=99999), "--vocab-size"),
    ]
    for args, needle in cases:
        with pytest.raises(DataError) as info:
            build_tokenizer(args)
        assert needle in str(info.value)


def test_train_bpe_on_text_and_jsonl(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 50 + "held hold help\n" * 50)
    jsonl = write_jsonl(tmp_path / "b.jsonl", ["hello there"] * 20)
    (tmp_path / "b.jsonl").open("a").write("not json\n")  # skipped when training
    out = train_bpe_tokenizer([str(text), jsonl], 300, str(tmp_path / "tok.json"))
    tok = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=out))
    assert tok.vocab_size <= 300 and tok.eod == 0
    assert len(tok.tokenize("hello world")) < len("hello world")


def test_tokenizer_train_cli(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", ["some words here and there"] * 30)
    assert tokenizer_train_main(["--input", corpus, "--vocab-size", "280", "--output",
                                 str(tmp_path), "--gpt2-files"]) == 0
    assert {"tokenizer.json", "vocab.json", "merges.txt"} <= set(os.listdir(tmp_path))
    assert tokenizer_train_main(["--input", corpus, "--vocab-size", "280", "--output",
                                 str(tmp_path / "new_dir")]) == 0  # made, gets tokenizer.json
    assert os.path.isfile(tmp_path / "new_dir" / "tokenizer.json")
    assert tokenizer_train_main(["--input", str(tmp_path / "missing*.jsonl"), "--vocab-size",
                                 "300", "--output", str(tmp_path / "x.json")]) == 2  # every user error: exit 2
    err = capsys.readouterr().err
    assert "error: --input" in err and "Traceback" not in err


def test_hf_special_tokens_switch(bpe_dir, tmp_path):
    """--tokenizer-hf-no-include-special-tokens (Megatron's): the tokenizer's template adds no BOS to the
    text's ids and decoding drops special tokens; by default both as the template says. The flag is a
    tokenizer flag, so `paratron preprocess` takes it too."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing

    from paratron.config.parse import add_tokenizer_args, tokenizer_config
    rust = RustTokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    bos = rust.token_to_id("<|endoftext|>")
    rust.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    path = str(tmp_path / "tokenizer.json")
    rust.save(path)
    with_bos = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    plain = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path,
                                  tokenizer_hf_no_include_special_tokens=True))
    ids = with_bos.tokenize(TEXTS[0])
    assert ids[0] == bos and plain.tokenize(TEXTS[0]) == ids[1:]
    assert plain.detokenize(ids) == TEXTS[0] and with_bos.detokenize(ids).startswith("<|endoftext|>")
    import argparse
    parser = argparse.ArgumentParser()
    add_tokenizer_args(parser)
    args = parser.parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path,
                              "--tokenizer-hf-no-include-special-tokens"])
    assert tokenizer_config(args).tokenizer_hf_no_include_special_tokens is True
