"""Issue 49's bad inputs of the command line and the start-up: each is caught before step 1 (or, for a
flag given twice, warned about), with one line naming the flag."""
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from paratron.cli import main
from paratron.config import ConfigError, parse_args
from paratron.config.parse import repeated_flags
from paratron.data.indices import parse_split
from paratron.errors import DataError

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--device", "cpu"]


def one_error_line(capsys) -> str:
    cap = capsys.readouterr()
    assert cap.err.count("\n") == 1 and cap.err.startswith("paratron: error: ") and "Traceback" not in cap.err, cap.err
    assert "iteration" not in cap.out  # before step 1
    return cap.err.strip()


@pytest.mark.parametrize("split, word", [("99,abc", "'abc' is not a number"), ("99,-1,2", "-1 is not a proportion"),
                                         ("1,2,3,4", "at most three"), ("0,0,0", "at least one positive")])
def test_a_split_that_is_not_proportions_is_refused(split, word):
    with pytest.raises(ConfigError, match=f"--split '{split}': .*{word}"):
        parse_args(FLAGS + ["--train-iters", "1", "--split", split])
    with pytest.raises(DataError, match=word):  # the datasets' own reading of it (library callers)
        parse_split(split)


def test_the_split_forms_megatron_takes_still_work():
    assert parse_args(FLAGS + ["--train-iters", "1", "--split", "98,2,0"]).data.split == "98,2,0"
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1/1/2") == pytest.approx([0.25, 0.25, 0.5])
    assert parse_split("100") == [1.0, 0.0, 0.0]


def test_save_interval_0_saves_at_the_end_only_as_megatron(tmp_path, capsys):
    assert main(["train", *FLAGS, "--train-iters", "3", "--save-interval", "0", "--save", str(tmp_path / "ck")]) == 0
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*")) == ["iter_0000003"]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_save_retain_interval_needs_a_save_interval_above_0(tmp_path):
    with pytest.raises(ConfigError, match="--save-retain-interval 2 must be a multiple of --save-interval 0"):
        parse_args(FLAGS + ["--train-iters", "3", "--save-interval", "0", "--save-retain-interval", "2",
                            "--save", str(tmp_path)])


def test_a_flag_given_twice_with_different_values_warns(capsys):
    cfg = parse_args(FLAGS + ["--train-iters", "1", "--lr", "2e-3"])
    assert cfg.optim.lr == 2e-3  # the last one, as argparse and Megatron
    out = capsys.readouterr().out
    assert " WARNING: --lr is given 2 times (1e-3, 2e-3); the last one, 2e-3, is used" in out, out
    assert repeated_flags(["--lr", "1e-3", "--lr=1e-3", "--bf16", "--bf16"]) == []  # the same value: no word
    assert repeated_flags(["--data-path", "a", "b", "--mock-data", "--data-path", "a"]) == [
        "WARNING: --data-path is given 2 times (a b, a); the last one, a, is used"]


def test_a_yaml_key_in_the_wrong_section_names_the_right_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  hidden_size: 64\n  train_iters: 2\n  no_check_for_nan_in_loss_and_grad: true\n")
    with pytest.raises(ConfigError, match=r"hidden_size \(in .*run.yaml\) is under train: but belongs under model:"):
        parse_args(FLAGS + ["--config", str(path)])
    path.write_text("model:\n  hidden_size: 32\ntrain:\n  train_iters: 2\n")  # in place: taken
    assert parse_args(FLAGS + ["--config", str(path)]).train.train_iters == 2


Usage = namedtuple("Usage", "total used free")


def test_a_save_directory_without_room_for_one_checkpoint_is_an_error_before_step_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 9, 10 ** 9 - 4096, 4096))
    flags = ["train", *FLAGS, "--train-iters", "1", "--save", str(tmp_path / "ck")]
    assert main(flags) == 2
    err = one_error_line(capsys)
    assert f"--save {tmp_path / 'ck'} has 0.0 MiB free but one checkpoint of this run takes about" in err, err
    assert "--no-save-space-check" in err
    assert main(flags + ["--no-save-space-check"]) in (0, 2)  # starts: the save itself may then fail
    assert " iteration        1/" in capsys.readouterr().out


def test_a_sample_prompt_the_tokenizer_cannot_read_is_an_error_before_step_1(capsys):
    assert main(["train", *FLAGS, "--train-iters", "1", "--sample-prompt", "hello"]) == 2
    err = one_error_line(capsys)
    assert "--sample-prompt 'hello' cannot be tokenized by --tokenizer-type NullTokenizer" in err, err
    assert '--sample-prompt "1 2 3"' in err
    assert main(["train", *FLAGS, "--train-iters", "1", "--sample-prompt", "1 2 300"]) == 2  # past --vocab-size
    assert "token id 300 outside the vocabulary" in one_error_line(capsys)
    assert main(["train", *FLAGS, "--train-iters", "1", "--sample-prompt", "1 2 3"]) == 0
    assert " sample: '1 2 3" in capsys.readouterr().out


WORKER = """
import multiprocessing as mp, sys
from paratron.train.guards import data_worker_init

def worker(q, quiet):
    if quiet:
        data_worker_init(None, 0)
    q.put(b"x" * (1 << 20))  # the main process is gone: its end of the pipe is closed
    q.close()
    q.join_thread()

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    q._reader.close()
    p = ctx.Process(target=worker, args=(q, sys.argv[1] == "quiet"))
    p.start()
    p.join()
"""


def test_a_data_worker_whose_main_process_is_gone_prints_no_traceback(tmp_path):
    """SIGTERM without --exit-signal-handler ends the main process; a DataLoader worker then writing to it
    printed the queue feeder's BrokenPipeError / ConnectionResetError traceback."""
    import os
    import subprocess
    import sys
    (tmp_path / "w.py").write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    run = [subprocess.run([sys.executable, str(tmp_path / "w.py"), how], capture_output=True, text=True, env=env,
                          timeout=60) for how in ("plain", "quiet")]
    assert "BrokenPipeError" in run[0].stderr  # what a worker prints without it
    assert run[1].returncode == 0 and run[1].stderr == "", run[1].stderr
