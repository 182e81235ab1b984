"""An unusable --save (or --tensorboard-dir, --data-cache-path) is one line before iteration 1, not a
traceback at the first save; a save that fails (a full disk, faked here) says so in one line,
leaves no partial directory and the previous checkpoint resumes."""
import errno
import os
from pathlib import Path

import pytest
import torch

from paratron.checkpoint.sharded import CheckpointError
from paratron.cli import main
from paratron.config import parse_args
from paratron.train.loop import Trainer

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--device", "cpu"]


def one_error_line(capsys) -> tuple[str, str]:
    cap = capsys.readouterr()
    assert cap.err.count("\n") == 1 and cap.err.startswith("paratron: error: ") and "Traceback" not in cap.err, cap.err
    return cap.err.strip(), cap.out


def read_only_dir(tmp_path: Path) -> str:
    """A directory that refuses new files. chmod does not stop root, so as root: /sys/kernel (sysfs
    refuses new files to everyone)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return str(d)
    if not Path("/sys/kernel").is_dir():
        pytest.skip("running as root without /sys/kernel: no directory refuses writes")
    return "/sys/kernel"


@pytest.mark.parametrize("where", ["under_a_file", "in_proc", "read_only"])
@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path"])
def test_unusable_output_directory_is_one_line_before_iteration_1(tmp_path, capsys, where, flag):
    (tmp_path / "file").write_text("x")
    path = {"under_a_file": str(tmp_path / "file" / "out"), "in_proc": "/proc/paratron-test/out",
            "read_only": read_only_dir(tmp_path) if where == "read_only" else ""}[where]
    assert main(["train", *FLAGS, "--train-iters", "2", flag, path]) == 2
    err, out = one_error_line(capsys)
    reason = {"under_a_file": "Not a directory", "in_proc": "No such file or directory",
              "read_only": "Permission denied"}[where]
    assert f"{flag} {path} cannot be written to: {reason}" in err, err
    assert "iteration" not in out  # found at start-up, before any training
    if where == "read_only" and os.geteuid() == 0:
        assert not list(Path(path).glob(".paratron-probe-*"))


def test_free_space_is_reported_beside_the_checkpoint_size(tmp_path, capsys):
    Trainer(parse_args(FLAGS + ["--train-iters", "1", "--save", str(tmp_path / "ck")]), data=(iter(()), None))
    out = capsys.readouterr().out
    assert f"--save {tmp_path / 'ck'}: " in out and "free; one checkpoint takes about" in out
    assert not list((tmp_path / "ck").iterdir())  # the probe file is gone


def test_a_full_disk_names_itself_removes_the_partial_save_and_the_previous_checkpoint_resumes(
        tmp_path, capsys, monkeypatch):
    root = tmp_path / "ck"
    flags = FLAGS + ["--train-iters", "4", "--save-interval", "2", "--save", str(root)]
    real_save, calls = torch.save, []

    def full_after_first_checkpoint(obj, f, *args, **kwargs):  # DCP writes each chunk with torch.save
        if (root / "latest_checkpointed_iteration.txt").exists():
            calls.append(f)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_after_first_checkpoint)
    assert main(["train", *flags]) == 2
    err, out = one_error_line(capsys)
    assert calls and "saved checkpoint at iteration       2" in out
    assert err == (f"paratron: error: saving iteration 4 to {root} failed: the disk is full (ENOSPC: no space left on "
                   "device); its partial directory was removed and the previous checkpoint (iteration 2) is intact")
    # (the tokenizer/ folder beside the checkpoints is written once, at the first save)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt", "tokenizer"]
    monkeypatch.setattr(torch, "save", real_save)
    t = Trainer(parse_args(flags + ["--load", str(root)]), data=(iter(()), None))
    assert t.iteration == 2 and "resumed from" in capsys.readouterr().out


def test_a_failed_first_save_says_there_is_no_earlier_checkpoint(tmp_path, monkeypatch):
    from paratron.checkpoint import sharded
    monkeypatch.setattr(sharded, "write_text_atomic",
                        lambda path, text: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system", str(path))))
    t = Trainer(parse_args(FLAGS + ["--train-iters", "1", "--save", str(tmp_path / "ck")]), data=(iter(()), None))
    with pytest.raises(CheckpointError) as e:
        t.save()
    assert "Read-only file system" in str(e.value) and "(EROFS)" in str(e.value)
    assert "there is no earlier checkpoint" in str(e.value) and "\n" not in str(e.value)
    # no partial checkpoint; the tokenizer/ folder (written before the first checkpoint) may stay
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name != "tokenizer"] == []
