"""tools/preprocess_data.py: output equal to Megatron's builder, bad input as one-line errors."""

import gzip
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import run_cli, small_corpus, train_tiny_bpe, write_jsonl  # noqa: E402

from paratron.data.indexed import IndexedDataset  # noqa: E402
from paratron.data.preprocess import main  # noqa: E402
from paratron.data.tokenizers import HuggingFaceTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return train_tiny_bpe(str(tmp_path_factory.mktemp("tok")))


def _flags(tok_path, inp, prefix, *extra):
    return ["--input", str(inp), "--output-prefix", str(prefix), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", tok_path, "--no-progress", *extra]


def _assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("paratron preprocess: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _no_outputs(folder):
    return [f for f in os.listdir(folder) if "_document" in f] == []


def test_output_matches_megatron_encoding(tmp_path, tok_path):
    texts = ["first document text", "", "second one, a bit longer than the first"]
    inp = write_jsonl(tmp_path / "in.jsonl", texts)
    assert main(_flags(tok_path, inp, tmp_path / "out", "--append-eod", "--workers", "1")) == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = HuggingFaceTokenizer(tok_path)
    # Megatron: tokens + EOD for non-empty documents; an empty one is a document of no sequence
    expected = [tok.tokenize(t) + [tok.eod] if t else [] for t in texts]
    assert ds.num_documents == 3 and len(ds) == 2
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    for i, ids in enumerate(expected):
        assert ds.document(i).tolist() == ids
    assert ds.dtype == np.uint16


def test_worker_count_does_not_change_output(tmp_path, tok_path):
    inp = small_corpus(tmp_path / "c.jsonl", 800)
    assert main(_flags(tok_path, inp, tmp_path / "one", "--workers", "1")) == 0
    assert main(_flags(tok_path, inp, tmp_path / "two", "--workers", "2")) == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"two_text_document{ext}").read_bytes()


def test_keys_gzip_glob_and_sentence_lists(tmp_path, tok_path):
    for i in range(2):
        with gzip.open(tmp_path / f"part{i}.jsonl.gz", "wt") as f:
            for j in range(3):
                f.write(json.dumps({"text": f"doc {i} {j}", "title": f"t{i}{j}",
                                    "sents": ["a b", "", "c"]}) + "\n")
    args = _flags(tok_path, tmp_path / "part*.jsonl.gz", tmp_path / "o", "--workers", "2",
                  "--partitions", "2", "--json-keys", "text", "title", "sents", "--append-eod")
    assert main(args) == 0
    text = IndexedDataset(str(tmp_path / "o_text_document"))
    title = IndexedDataset(str(tmp_path / "o_title_document"))
    sents = IndexedDataset(str(tmp_path / "o_sents_document"))
    assert text.num_documents == title.num_documents == sents.num_documents == 6
    tok = HuggingFaceTokenizer(tok_path)
    assert text.document(4).tolist() == tok.tokenize("doc 1 1") + [tok.eod]
    # a list is pre-split sentences: each non-empty one a sequence, EOD on the last
    assert len(sents) == 12
    assert sents[1].tolist() == tok.tokenize("c") + [tok.eod]


def test_malformed_lines_skipped_and_reported(tmp_path, tok_path):
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(b'{"text": "good one"}\n{"text": broken\n{"other": 1}\n'
                    b'{"text": "caf\xe9 latin-1"}\n[1, 2]\n\n{"text": "good two"}\n')
    proc = run_cli(_flags(tok_path, inp, tmp_path / "o", "--workers", "2"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in ("bad.jsonl:2: invalid JSON", "bad.jsonl:3: missing key 'text'",
                   "bad.jsonl:4: not valid UTF-8", "bad.jsonl:5: not a JSON object",
                   "4 malformed lines skipped"):
        assert needle in proc.stderr, proc.stderr
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 2


@pytest.mark.parametrize("content,needle", [
    (b'{"text": "ok"}\n{"text": oops}\n', "bad.jsonl:2: invalid JSON"),
    (b'{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: missing key 'text'"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "bad.jsonl:2: not valid UTF-8"),
])
def test_strict_makes_malformed_fatal(tmp_path, tok_path, content, needle):
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(content * 3000)  # several chunks, so workers are mid-flight on the error
    proc = run_cli(_flags(tok_path, inp, tmp_path / "o", "--workers", "2", "--strict"))
    _assert_one_line_error(proc, needle, "--strict")
    assert _no_outputs(tmp_path)


def test_empty_and_missing_inputs(tmp_path, tok_path):
    (tmp_path / "empty.jsonl").write_text("")
    proc = run_cli(_flags(tok_path, tmp_path / "empty.jsonl", tmp_path / "o", "--workers", "2"))
    _assert_one_line_error(proc, "empty.jsonl", "no documents")
    (tmp_path / "junk.jsonl").write_text("nope\n{}\n")
    proc = run_cli(_flags(tok_path, tmp_path / "junk.jsonl", tmp_path / "o", "--workers", "1"))
    _assert_one_line_error(proc, "no documents", "all 2 lines malformed")
    proc = run_cli(_flags(tok_path, tmp_path / "missing.jsonl", tmp_path / "o", "--workers", "1"))
    _assert_one_line_error(proc, "missing.jsonl", "no such file")
    assert _no_outputs(tmp_path)


def test_flag_errors(tmp_path, tok_path):
    inp = write_jsonl(tmp_path / "in.jsonl", ["x"])
    proc = run_cli(_flags(tok_path, inp, tmp_path / "o", "--workers", "3", "--partitions", "2"))
    _assert_one_line_error(proc, "--partitions 2")
    proc = run_cli(_flags(tok_path, inp, tmp_path / "o", "--workers", "1", "--split-sentences", "--lang", "german"))
    _assert_one_line_error(proc, "--lang german")
    proc = run_cli(["--input", inp, "--output-prefix", tmp_path / "o", "--workers", "1",
                    "--tokenizer-type", "NullTokenizer"])
    _assert_one_line_error(proc, "--vocab-size")
    proc = run_cli(_flags(tok_path, inp, tmp_path / "o"))  # --workers is required
    assert proc.returncode == 2 and "--workers" in proc.stderr and "Traceback" not in proc.stderr
    assert _no_outputs(tmp_path)


def test_null_tokenizer_pretokenized_input(tmp_path):
    inp = write_jsonl(tmp_path / "ids.jsonl", ["1 2 3", "4 5", "7 999"])
    args = ["--input", inp, "--output-prefix", tmp_path / "n", "--workers", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr
    assert "ids.jsonl:3: tokenizer failed" in proc.stderr
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [ds.document(i).tolist() for i in range(2)] == [[1, 2, 3, 99], [4, 5, 99]]


def test_progress_lines_when_not_a_tty(tmp_path, tok_path):
    inp = small_corpus(tmp_path / "c.jsonl", 9000)  # several chunks of lines
    flags = [f for f in _flags(tok_path, inp, tmp_path / "o") if f != "--no-progress"]
    proc = run_cli(flags + ["--workers", "1", "--log-interval", "4000"])
    assert proc.returncode == 0
    progress = [line for line in proc.stderr.splitlines() if line.startswith("processed ")]
    counts = [int(line.split()[1]) for line in progress]
    assert len(counts) == 2 and 4000 <= counts[0] < 8000 <= counts[1]  # one line per 4000
    assert all("docs/s" in line and "MB/s" in line for line in progress)
