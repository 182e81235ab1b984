"""One error hierarchy, one convention: every command ends a user error with one line on stderr,
``<command>: error: <message>``, and exit code 2; flags that would do nothing are such errors; the
tokenizer flags are one set for train and preprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratron.cli import main, pretrain_main
from tests.data_helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", "tiny", "--train-iters", "2", "--eval-iters", "0"]


def one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prefix}: error: ") and "Traceback" not in err, err
    return err


def test_error_classes_share_one_base():
    from paratron.checkpoint.hf_config import ConversionError
    from paratron.checkpoint.sharded import CheckpointError
    from paratron.config import ConfigError, FrozenConfigError
    from paratron.data import DataError
    from paratron.errors import UserError
    for cls in (ConfigError, FrozenConfigError, DataError, CheckpointError, ConversionError):
        assert issubclass(cls, UserError), cls


@pytest.mark.parametrize("flags,needle", [
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "a2a"],
     "--cp-comm-type p2p a2a a2a: give one type, or one per layer (2 for --num-layers 2; got 3)"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 has no effect without --num-experts"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2 has no effect without --num-experts"),
    (["--sample-prompt", "def", "--pipeline-model-parallel-size", "2"], "--sample-prompt needs the whole model"),
])
def test_flags_that_would_do_nothing_are_errors(capsys, flags, needle):
    assert main(["train", *TINY, *flags]) == 2
    assert needle in one_error_line(capsys, "paratron")


def test_no_op_flag_error_in_a_real_process():
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--context-parallel-size", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("pretrain_gpt.py: error: world size 1 is not divisible by TP 1 x PP 1 x CP 2")


def test_every_command_reports_a_user_error_as_one_line_and_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    cases = [  # (argv of `paratron`, prefix of the error line, words in it)
        (["train", *TINY, "--hiden-size", "8"], "paratron", "did you mean --hidden-size"),  # ConfigError
        (["train", *TINY, "--data-path", str(tmp_path / "nope")], "paratron", "nope"),  # DataError (dataset)
        (["train", *TINY, "--load", str(tmp_path / "none"), "--exit-on-missing-checkpoint"], "paratron",
         "no checkpoint found"),  # CheckpointError
        (["demo", "--corpus-mb", "many"], "paratron", "--corpus-mb"),
        (["trian"], "paratron", "did you mean `paratron train`"),
        (["tokenizer"], "paratron", "paratron tokenizer train"),
        (["preprocess", "--input", missing, "--output-prefix", str(tmp_path / "o"), "--workers", "1",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"], "paratron preprocess", "no such file"),
        (["preprocess", "--input", missing, "--output-prefix", str(tmp_path / "o"), "--workers", "one"],
         "paratron preprocess", "--workers"),  # an argparse error: one line too
        (["preprocess", "--input", missing, "--output-prefix", str(tmp_path / "o"), "--workers", "1"],
         "paratron preprocess", "--tokenizer-type"),
        (["tokenizer", "train", "--input", missing, "--vocab-size", "300", "--output", str(tmp_path / "t.json")],
         "paratron tokenizer train", "no such file"),
        (["tokenizer", "train", "--input", missing], "paratron tokenizer train", "--vocab-size"),
        (["convert", "--to", "hf"], "paratron convert", "--load"),  # ConversionError
        # Megatron's flags given to the serving commands: named, with why they do not take them
        (["serve", "--load", str(tmp_path), "--tensor-model-parallel-size", "2"], "paratron",
         "every process torchrun starts"),
        (["generate", "--load", str(tmp_path), "--num-layers", "4"], "paratron", "--num-layers is a training flag"),
        (["serve", "--load", str(tmp_path), "--inference-max-seq-length", "9", "--flash-decode"], "paratron",
         "--flash-decode (Megatron-LM's) is not a paratron serve flag"),
        (["serve", "--load", str(tmp_path), "--bogus"], "paratron", "unrecognized arguments: --bogus"),
        # a flag paratron had and removed: named, with why
        (["generate", "--load", str(tmp_path), "--kernel-decode-prefetch", "on"], "paratron",
         "--kernel-decode-prefetch is no longer a paratron flag: the fused decode attention's loads ahead"),
        (["train", *TINY, "--kernel-decode-prefetch", "on"], "paratron", "is no longer a paratron flag"),
    ]
    for argv, prefix, needle in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert needle in one_error_line(capsys, prefix), argv
    assert pretrain_main(["--num-layer", "2"]) == 2
    assert "did you mean --num-layers" in one_error_line(capsys, "pretrain_gpt.py")


# ---- one tokenizer flag set ---------------------------------------------------------------------
def test_tiktoken_pattern_is_a_training_flag(tmp_path):
    pytest.importorskip("tiktoken")
    from paratron.train.resolve import parse_args
    from paratron.data.tokenizers import TIKTOKEN_PATTERNS, build_tokenizer
    from tests.data_helpers import write_tiktoken_file
    path = write_tiktoken_file(tmp_path / "v.tiktoken")
    cfg = parse_args(TINY + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern", "v1",
                             "--tiktoken-num-special-tokens", "100", "--vocab-size", "366"])
    assert cfg.data.tiktoken_pattern == "v1"
    tok = build_tokenizer(cfg.data)
    assert tok._enc._pat_str == TIKTOKEN_PATTERNS["v1"] and cfg.data.vocab_size == tok.vocab_size == 100 + 266
    with pytest.raises(Exception, match="--tiktoken-pattern must be v1 or v2"):
        parse_args(TINY + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern", "v3"])


def test_vocab_extra_ids_give_one_vocabulary_in_preprocess_and_train(tmp_path):
    pytest.importorskip("sentencepiece")
    from paratron.train.resolve import parse_args
    from paratron.data.indexed import IndexedDataset
    from paratron.data.preprocess import main as preprocess_main
    from paratron.data.tokenizers import build_tokenizer
    from tests.data_helpers import train_tiny_sentencepiece
    model = train_tiny_sentencepiece(tmp_path / "sp.model")
    tok_flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model, "--vocab-extra-ids", "5"]
    text = "the model <extra_id_4> data"
    inp = write_jsonl(tmp_path / "c.jsonl", [text] * 40)
    assert preprocess_main(["--input", inp, "--output-prefix", str(tmp_path / "c"), "--workers", "1",
                            "--no-progress", *tok_flags]) == 0
    cfg = parse_args(TINY + ["--data-path", str(tmp_path / "c_text_document"), *tok_flags])
    tok = build_tokenizer(cfg.data)  # what the Trainer builds
    assert cfg.data.vocab_extra_ids == 5 and cfg.data.vocab_size == tok.vocab_size
    assert tok.vocab_size == build_tokenizer(cfg.data.unfrozen()).vocab_size
    written = IndexedDataset(str(tmp_path / "c_text_document")).document(0).tolist()
    assert written == tok.tokenize(text)  # the ids preprocess wrote are the training tokenizer's
    extra = tok.tokenize("<extra_id_4>")
    assert len(extra) == 1 and extra[0] in written and max(written) < cfg.data.vocab_size
    without = cfg.data.unfrozen()
    without.vocab_extra_ids = 0
    assert cfg.data.vocab_size == build_tokenizer(without).vocab_size + 5


def test_preprocess_has_the_training_tokenizer_flags():
    from paratron.config import TOKENIZER_FIELDS, build_parser, flag
    from paratron.data.preprocess import build_parser as preprocess_parser

    def options(parser):
        return {s for a in parser._actions for s in a.option_strings}
    want = {flag(n) for n in TOKENIZER_FIELDS}
    assert want <= options(preprocess_parser()) and want <= options(build_parser())
    assert {"--tiktoken-pattern", "--vocab-extra-ids", "--tokenizer-special-tokens"} <= want


def test_preprocess_subprocess_uses_the_same_convention(tmp_path):
    r = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "x.jsonl"),
                        "--output-prefix", str(tmp_path / "o"), "--workers", "1", "--tokenizer-type", "Null"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--tokenizer-type Null is not supported; did you mean NullTokenizer?" in r.stderr


def test_under_torchrun_a_higher_rank_waits_and_every_rank_writes_the_error_file(tmp_path, monkeypatch, capsys):
    import json
    from paratron import errors
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setattr(errors.signal, "signal", lambda *a: None)
    for rank in (0, 3):
        path = tmp_path / f"{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        errors.report_user_error("x: error: bad")
        assert json.loads(path.read_text())["message"] == "x: error: bad"
    assert slept == [errors.rank_grace_s(3)] and errors.rank_grace_s(3) > 0
    assert capsys.readouterr().err == "x: error: bad\nx: error: bad\n"


@pytest.mark.parametrize("command", ["train", "plan", "generate", "serve", "convert"])
def test_help_imports_no_torch(command):
    """``paratron <command> --help`` answers from the flags alone: importing torch (and its compiler) took seconds
    before the help appeared."""
    code = (f"import sys\nfrom paratron.cli import main\ntry:\n    main([{command!r}, '--help'])\nfinally:\n"
            "    print('torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "usage:" in out.stdout and out.stderr.strip() == "False", out.stderr[-2000:]
