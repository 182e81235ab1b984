"""The embedded demo corpus and the corpus -> tokenizer -> .bin/.idx chain."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import StubTokenizer, build_datasets, data_args  # noqa: E402

from paratron.data.corpus import (  # noqa: E402
    prepare_demo_data, python_stdlib_corpus, stdlib_source_files,
)
from paratron.data.indexed import IndexedDataset  # noqa: E402
from paratron.data.tokenizers import HuggingFaceTokenizer  # noqa: E402


def test_stdlib_files_in_fixed_order_without_tests_or_site_packages():
    import hashlib
    rels = [rel for rel, _ in stdlib_source_files()]
    assert rels == sorted(rels, key=lambda r: hashlib.md5(r.encode()).hexdigest()) and len(rels) > 100
    assert rels != sorted(rels)  # spread over the library, not alphabetical
    assert not any(r.startswith("encodings/") for r in rels)
    assert "os.py" in rels and "json/decoder.py" in rels
    for rel in rels:
        parts = rel.split("/")
        assert "site-packages" not in parts and "test" not in parts and "tests" not in parts


def test_corpus_is_deterministic_and_capped(tmp_path):
    a = python_stdlib_corpus(str(tmp_path / "a.jsonl"), max_bytes=200_000)
    b = python_stdlib_corpus(str(tmp_path / "b.jsonl"), max_bytes=200_000)
    assert a == b and 0 < a["bytes"] <= 200_000
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) == a["files"]
    assert all(set(json.loads(line)) == {"text"} for line in lines)


def test_prepare_demo_data_chain_and_reuse(tmp_path):
    work = str(tmp_path / "demo")
    prefix, tok_path = prepare_demo_data(work, vocab_size=400, max_bytes=300_000)
    data = IndexedDataset(prefix)
    tok = HuggingFaceTokenizer(tok_path)
    assert tok.vocab_size <= 400 and data.num_tokens > 10_000
    first = json.loads(open(os.path.join(work, "stdlib.jsonl")).readline())["text"]
    assert data.document(0).tolist() == tok.tokenize(first) + [tok.eod]
    stamp = os.path.getmtime(prefix + ".bin")
    start = time.time()
    assert prepare_demo_data(work, vocab_size=400, max_bytes=300_000) == (prefix, tok_path)
    assert time.time() - start < 1.0 and os.path.getmtime(prefix + ".bin") == stamp
    args = data_args(data_path=[prefix], seq_length=64, split="70,20,10", data_cache_path=str(tmp_path / "c"))
    train, valid, _ = build_datasets(args, StubTokenizer(tok.vocab_size, tok.eod))
    assert len(train) >= 160 and valid is not None
    prefix2, _ = prepare_demo_data(work, vocab_size=300, max_bytes=300_000)  # new settings
    assert HuggingFaceTokenizer(tok_path).vocab_size <= 300
    assert os.path.getmtime(prefix2 + ".bin") >= stamp
