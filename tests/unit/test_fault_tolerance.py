"""Fault tolerance (docs/reliability.md): NaN/Inf and spiky losses stop the run, the LR schedule is
reconciled on resume with Megatron's flags, data is checked before step 1, SIGTERM and kill -9 resume
exactly."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from paratron.config import ConfigError, parse_args
from paratron.data.errors import DataError
from paratron.data.indexed import write_dataset
from paratron.train.guards import NumericalError, StepGuard
from paratron.train.loop import Trainer, pretrain
from tests.unit.test_train import ROOT, TINY, losses_of

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+|NAN|nan) \|")


def cli(flags, timeout=120):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--device", "cpu", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


# ---- NaN / Inf / spikes --------------------------------------------------------------------------
def test_nan_loss_stops_within_two_iterations_and_saves_nothing(tmp_path):
    ck = tmp_path / "ck"
    r = cli(["--lr", "1e6", "--train-iters", "20", "--save", str(ck), "--save-interval", "1"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--no-check-for-nan-in-loss-and-grad" in err[0], err
    logged = {int(i): float(v) for i, v in LOSS.findall(r.stdout)}
    first_nan = min(i for i, v in logged.items() if v != v)
    assert f"at iteration {first_nan} on rank 0" in err[0]
    assert max(logged) <= first_nan + 1  # stopped within 2 iterations of the first NaN
    saved = sorted(int(p.name[5:]) for p in ck.glob("iter_*"))
    assert saved and max(saved) < first_nan and int((ck / "latest_checkpointed_iteration.txt").read_text()) < first_nan


def test_nan_check_off_trains_on_and_counts_nan_iterations():
    result = pretrain(parse_args(TINY + ["--lr", "1e6", "--train-iters", "4", "--eval-iters", "0",
                                         "--no-check-for-nan-in-loss-and-grad"]))
    assert result["iteration"] == 4 and result["trainer"].nan_iters > 0


def test_fp16_overflow_is_skipped_not_fatal():
    """Loss scaling: an overflowing scaled gradient skips the step (and lowers the scale); only a
    non-finite loss stops an --fp16 run."""
    result = pretrain(parse_args(TINY + ["--train-iters", "3", "--eval-iters", "0", "--fp16"]))  # scale 2^32
    t = result["trainer"]
    assert result["iteration"] == 3 and t.skipped >= 1 and t.optimizer.loss_scale < 2.0 ** 32


def guard_run(guard, losses, norm=1.0):
    for i, loss in enumerate(losses, 1):
        guard.record(i, torch.tensor([loss * 10.0, 10.0]), norm)
    guard.check()


def test_spiky_loss_is_reported_and_can_stop():
    seen = []
    guard = StepGuard(True, True, True, 10.0, False, rank=3, report=seen.append)
    guard_run(guard, [5.0, 4.0, 49.0, 3.0, 600.0, 500.0])  # 49 < 10 x 5 raises the max; 600 and 500 > 10 x 49
    assert guard.spikes == 2 and len(seen) == 2 and "at iteration 5 on rank 3" in seen[0] and "4.9" in seen[0]
    with pytest.raises(NumericalError, match="spiky loss at iteration 3 on rank 0"):
        guard_run(StepGuard(True, True, True, 10.0, True, rank=0, report=seen.append), [5.0, 4.0, 60.0])


def test_nan_guard_reads_grad_norm_except_with_fp16():
    with pytest.raises(NumericalError, match="gradient norm is inf at iteration 1 on rank 1"):
        guard_run(StepGuard(True, True, False, 10.0, False, rank=1, report=print), [5.0, 4.0], float("inf"))
    guard_run(StepGuard(True, False, False, 10.0, False, rank=1, report=print), [5.0, 4.0], float("inf"))  # fp16
    with pytest.raises(NumericalError, match="loss is nan at iteration 1"):
        guard_run(StepGuard(True, False, False, 10.0, False, rank=0, report=print), [float("nan")])


# ---- the LR schedule on resume -------------------------------------------------------------------
SCHED = TINY + ["--train-iters", "6", "--lr-warmup-iters", "1", "--lr-decay-style", "linear", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def sched_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched") / "ck"
    t = Trainer(parse_args(SCHED + ["--lr", "1e-3", "--save", str(root)]))
    losses_of(t, 3)  # 12 samples of a schedule of 24: warm-up 4, then linear to 0
    t.save()
    return root


def lrs_after_load(root, flags, steps=1):
    t = Trainer(parse_args(SCHED + ["--load", str(root)] + flags))
    out = [t.optimizer.adam.param_groups[0]["lr"]]
    for _ in range(steps):
        t.train_step()
        out.append(t.optimizer.adam.param_groups[0]["lr"])
    return out


def test_changed_schedule_on_resume_is_an_error_naming_values_and_flags(sched_ckpt):
    with pytest.raises(ConfigError) as e:
        Trainer(parse_args(SCHED + ["--lr", "2e-3", "--min-lr", "1e-5", "--load", str(sched_ckpt)]))
    msg = str(e.value)
    assert "--lr 0.002 here, 0.001 in the checkpoint" in msg and "--min-lr 1e-05 here, 0.0 in the checkpoint" in msg
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" in msg
    with pytest.raises(ConfigError, match="decay samples .* 40 here, 24 in the checkpoint"):
        Trainer(parse_args(SCHED[:-4] + ["--train-iters", "10", "--eval-iters", "0", "--lr", "1e-3",
                                         "--load", str(sched_ckpt)]))


def test_override_takes_the_command_line_schedule(sched_ckpt):
    # linear: lr(n) = peak x (1 - (n - 4) / 20) at n samples; the position (12 samples) is the checkpoint's
    got = lrs_after_load(sched_ckpt, ["--lr", "2e-3", "--override-opt_param-scheduler"], 2)
    assert got == pytest.approx([2e-3 * 0.6, 2e-3 * 0.4, 2e-3 * 0.2], rel=1e-12)


def test_use_checkpoint_keeps_the_checkpoint_schedule(sched_ckpt):
    got = lrs_after_load(sched_ckpt, ["--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"], 2)
    assert got == pytest.approx([1e-3 * 0.6, 1e-3 * 0.4, 1e-3 * 0.2], rel=1e-12)


def test_same_schedule_resumes_without_flags(sched_ckpt):
    assert lrs_after_load(sched_ckpt, ["--lr", "1e-3"], 0) == pytest.approx([6e-4], rel=1e-12)


# ---- data checked before step 1 ------------------------------------------------------------------
def dataset(tmp_path, name="d", docs=40, high=200, extra=None):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, high, size=int(rng.integers(20, 60))) for _ in range(docs)]
    if extra is not None:
        documents[7][3] = extra
    prefix = str(tmp_path / name)
    write_dataset(prefix, documents)
    return prefix


def data_flags(prefix, *more):
    flags = [f for f in TINY if f != "--mock-data"]
    return flags + ["--data-path", prefix, "--data-cache-path", os.path.dirname(prefix) + "/cache", *more]


def test_token_id_beyond_vocab_is_a_one_line_error_before_step_1(tmp_path):
    prefix = dataset(tmp_path, extra=300)
    r = cli(["--data-path", prefix, "--train-iters", "2", "--lr", "1e-3", "--mock-data", "false"])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert f"{prefix}.bin holds token id 300" in err[0] and "vocabulary has 256 ids" in err[0]
    assert "iteration" not in r.stdout
    cache = prefix + ".idx.tokens.json"
    assert os.path.isfile(cache) and '"max": 300' in open(cache).read()
    with pytest.raises(DataError, match="token id 300"):  # the cached value gives the same answer
        Trainer(parse_args(data_flags(prefix, "--train-iters", "2")))


@pytest.mark.parametrize("which", ["bin", "idx"])
def test_truncated_files_are_errors_before_step_1(tmp_path, which):
    prefix = dataset(tmp_path)
    path = f"{prefix}.{which}"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 6)
    with pytest.raises(DataError, match=f"{re.escape(path)}: .*truncated"):
        Trainer(parse_args(data_flags(prefix, "--train-iters", "2")))


def test_split_evaluates_test_data_after_training(tmp_path, capsys):
    prefix = dataset(tmp_path, docs=60)
    result = pretrain(parse_args(data_flags(prefix, "--train-iters", "3", "--split", "90,5,5", "--eval-interval", "3")))
    out = capsys.readouterr().out
    assert result["iteration"] == 3
    assert re.search(r"validation loss at the end of training for test data \| lm loss value: [0-9.]+E\+00 \| "
                     r"lm loss PPL: [0-9.]+E\+\d\d \|", out), out[-2000:]


def test_empty_validation_split_is_a_warning(tmp_path, capfd):
    prefix = dataset(tmp_path, docs=10)
    result = pretrain(parse_args(data_flags(prefix, "--train-iters", "2", "--split", "98,1,1")))
    assert result["iteration"] == 2 and result["valid_loss"] is None
    err = capfd.readouterr().err
    assert "WARNING" in err and "the valid split" in err and "training goes on without it" in err, err


# ---- SIGTERM and kill -9 -------------------------------------------------------------------------
STOP = ["--train-iters", "100", "--num-workers", "2", "--eval-iters", "0", "--save-interval", "2"]


def run_until(flags, kill_after: int, sig):
    """Run pretrain_gpt.py; send ``sig`` to its whole process group (main process and DataLoader
    workers) once iteration ``kill_after`` is logged. Returns (exit code, {iteration: loss})."""
    cmd = [sys.executable, "pretrain_gpt.py", *TINY, "--device", "cpu", *STOP, *flags]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = []
    for line in p.stdout:
        out.append(line)
        if sig is not None and re.search(rf"iteration\s+{kill_after}/", line):
            os.killpg(p.pid, sig)
            break
    out.append(p.stdout.read())
    rc = p.wait(timeout=120)
    text = "".join(out)
    return rc, {int(i): float(v) for i, v in LOSS.findall(text)}, text


@pytest.fixture(scope="module")
def straight():
    rc, losses, text = run_until(["--exit-interval", "8"], 0, None)
    assert rc == 0 and sorted(losses) == list(range(1, 9)), text[-2000:]
    return losses


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_interrupted_run_resumes_exactly(tmp_path, straight, sig):
    ck = str(tmp_path / "ck")
    rc, first, text = run_until(["--save", ck, "--exit-signal-handler", "--exit-interval", "8"], 3, sig)
    latest = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read())
    if sig == signal.SIGTERM:  # finishes the step it is in, saves that iteration, exits 0
        assert rc == 0 and "Traceback" not in text and latest == max(first), text[-2000:]
    else:
        assert rc == -signal.SIGKILL and latest in (2, 4)  # the last complete save
    rc, rest, text = run_until(["--load", ck, "--save", ck, "--exit-signal-handler", "--exit-interval", "8"], 0, None)
    assert rc == 0 and sorted(rest) == list(range(latest + 1, 9)), text[-2000:]
    assert all(rest[i] == straight[i] for i in rest), (rest, straight)


def test_exit_duration_saves_and_a_signal_during_the_save_changes_nothing(tmp_path, monkeypatch):
    """--exit-duration-in-mins stops after the step and saves it; a SIGTERM arriving during that save
    (the second signal of a preemption) only sets the flag again: the save completes and is the latest."""
    from paratron.checkpoint import sharded
    real_save = sharded.save

    def save_with_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)
    monkeypatch.setattr(sharded, "save", save_with_a_signal)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        result = pretrain(parse_args(TINY + ["--train-iters", "50", "--eval-iters", "0", "--exit-duration-in-mins",
                                             "1e-9", "--exit-signal-handler", "--save", str(tmp_path / "ck")]))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result["iteration"] == 1 and result["trainer"].stop_signal.received
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "1"
    sharded.verify_checkpoint(tmp_path / "ck" / "iter_0000001")


def test_no_unsafe_loading_of_user_files():
    """Every torch.load passes weights_only=True; no pickle.load(s), eval/exec, yaml.load or np.load with
    pickles anywhere in paratron/ (DCP's index goes through the restricted unpickler of pieces.py)."""
    import ast
    from pathlib import Path
    bad = []
    for path in (Path(ROOT) / "paratron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            kw = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
            if ((owner, name) == ("torch", "load") and kw.get("weights_only") is not True
                    or (owner, name) in {("pickle", "load"), ("pickle", "loads"), ("yaml", "load"),
                                         ("yaml", "unsafe_load"), ("np", "load")} and kw.get("allow_pickle") is not False
                    or (owner, name) == ("", "eval") or (owner, name) == ("", "exec")):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


def test_validation_line_of_a_nan_loss_has_a_nan_perplexity():
    from paratron.train.logger import format_valid_line
    assert "lm loss PPL: NAN" in format_valid_line(3, float("nan"))
    assert "lm loss PPL: INF" in format_valid_line(3, float("inf"))
    assert "at the end of training for test data | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00" in \
        format_valid_line("the end of training for test data", 2.0)
