"""Every planned exit says why in one log line; --exit-duration-in-mins counts from start-up (the
Trainer's construction), as Megatron's, not from the first iteration."""
import os
import re
import signal

from paratron.config import parse_args
from paratron.train.loop import Trainer

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--device", "cpu", "--train-iters", "5"]


def run(capsys, *flags, before=None) -> tuple[int, str]:
    t = Trainer(parse_args(FLAGS + list(flags)))
    if before:
        before(t)
    try:
        result = t.train()
    finally:
        t.close()
    return result["iteration"], capsys.readouterr().out


def test_exit_interval_says_so(capsys):
    it, out = run(capsys, "--exit-interval", "2")
    assert it == 2 and " exiting after 2 iterations: --exit-interval 2\n" in out


def test_exit_duration_counts_from_start_up(capsys):
    def started_two_minutes_ago(t):
        t.start_time -= 120.0
    it, out = run(capsys, "--exit-duration-in-mins", "1", before=started_two_minutes_ago)
    # the minutes since start-up: the two set back plus the run's own (seconds on a loaded machine)
    found = re.search(r" exiting after 1 iterations: --exit-duration-in-mins 1 \((\d+\.\d+) min since start-up\)", out)
    assert it == 1 and found and 2.0 <= float(found.group(1)) < 3.0, out


def test_a_signal_says_so(capsys):
    old = signal.getsignal(signal.SIGTERM)
    try:
        it, out = run(capsys, "--exit-signal-handler", before=lambda t: os.kill(os.getpid(), signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert it == 1 and " exiting after 1 iterations: SIGTERM (--exit-signal-handler)" in out, out


def test_exit_signal_chooses_the_signal(capsys):
    """--exit-signal SIGUSR1 (Megatron's): that signal stops the run; SIGTERM is left alone; a signal
    that cannot be caught, or no signal at all, is a one-line error."""
    import pytest
    from paratron.config import ConfigError
    old = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        it, out = run(capsys, "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                      before=lambda t: os.kill(os.getpid(), signal.SIGUSR1))
        assert signal.getsignal(signal.SIGTERM) == old[1]
    finally:
        signal.signal(signal.SIGUSR1, old[0])
    assert it == 1 and " exiting after 1 iterations: SIGUSR1 (--exit-signal-handler)" in out, out
    for bad in ("SIGKILL", "SIGFOO"):
        with pytest.raises(ConfigError, match=f"--exit-signal {bad} is not a signal a process can catch"):
            parse_args(FLAGS + ["--exit-signal", bad])


def test_log_memory_interval_prints_megatrons_memory_line(capsys):
    """--log-memory-interval N (a multiple of --log-interval): Megatron's report_memory line every N
    iterations on data-parallel rank 0."""
    import pytest
    from paratron.config import ConfigError
    it, out = run(capsys, "--train-iters", "4", "--log-memory-interval", "2")
    lines = [line for line in out.splitlines() if "memory (MB) | allocated:" in line]
    assert [line.split(")")[0] for line in lines] == ["[Rank 0] (after 2 iterations", "[Rank 0] (after 4 iterations"]
    assert all("| max allocated: " in line and "| max reserved: " in line for line in lines)
    with pytest.raises(ConfigError, match="--log-memory-interval 3 must be a multiple of --log-interval 2"):
        parse_args(FLAGS + ["--log-interval", "2", "--log-memory-interval", "3"])


def test_reaching_train_iters_is_no_early_exit(capsys):
    it, out = run(capsys, "--train-iters", "2", "--exit-interval", "2")
    assert it == 2 and "exiting after" not in out


def test_train_sync_interval_waits_for_the_gpu_every_n_steps(monkeypatch):
    """--train-sync-interval N (Megatron's): the host waits for the GPU after every N-th step only (a
    CUDA run; a CPU run has nothing to wait for)."""
    from types import SimpleNamespace

    import torch

    from paratron.train.reporting import Reporter
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    cfg = parse_args(FLAGS + ["--train-sync-interval", "3"])
    for device, expected in ((torch.device("cuda"), [3, 6]), (torch.device("cpu"), [])):
        calls.clear()
        rep = object.__new__(Reporter)
        rep.lg, rep.writes = cfg.log, False
        rep.t = SimpleNamespace(cfg=cfg, device=device, iteration=0)
        synced = []
        for it in range(1, 8):
            rep.t.iteration = it
            before = len(calls)
            rep.after_step(None, None, 0.0)
            if len(calls) > before:
                synced.append(it)
        assert synced == expected


def test_iterations_to_skip_read_their_batch_and_train_nothing(capsys):
    """--iterations-to-skip 2 4 (Megatron's): steps 2 and 4 read their micro-batches (the data stream
    stays where it would be) and change no weight; the others train as usual."""
    import torch
    ran = []
    t = Trainer(parse_args(FLAGS + ["--iterations-to-skip", "4", "2", "--train-iters", "5"]))
    step = t.train_step

    def counted():
        ran.append(t.iteration + 1)
        return step()
    t.train_step = counted
    try:
        result = t.train()
        weights = [p.detach().clone() for p in t.model.parameters()]
        consumed = t.consumed_samples
    finally:
        t.close()
    out = capsys.readouterr().out
    assert result["iteration"] == 5 and ran == [1, 3, 5] and consumed == 5 * t.cfg.train.global_batch_size
    assert " skipped iteration 2 (--iterations-to-skip)" in out and " skipped iteration 4 (" in out
    plain = Trainer(parse_args(FLAGS + ["--train-iters", "5"]))
    try:
        plain.train()
        assert not all(torch.equal(a, b) for a, b in zip(weights, plain.model.parameters()))
    finally:
        plain.close()


def test_skip_train_only_evaluates_and_start_eval_at_iter(capsys):
    import pytest
    from paratron.config import ConfigError
    it, out = run(capsys, "--skip-train", "--eval-iters", "1", "--eval-interval", "2")
    assert it == 0 and "validation loss at iteration 0" in out and "iteration        1/" not in out, out
    it, out = run(capsys, "--eval-iters", "1", "--eval-interval", "1", "--start-eval-at-iter", "4")
    assert [line.split(" | ")[0].strip() for line in out.splitlines() if "validation loss at iteration" in line] \
        == ["validation loss at iteration 4", "validation loss at iteration 5"], out
    with pytest.raises(ConfigError, match="--iterations-to-skip takes step numbers >= 1"):
        parse_args(FLAGS + ["--iterations-to-skip", "0"])
