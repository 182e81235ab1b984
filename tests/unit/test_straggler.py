"""--log-straggler (Megatron's straggler detector): the per-interval line of the slowest and fastest
ranks, its on/off switch on --straggler-ctrlr-port, and on two gloo ranks the slow one is named."""
import socket
from types import SimpleNamespace
import time

import pytest

from paratron.config import ConfigError, parse_args
from paratron.train.loop import Trainer
from tests.dist import free_port, run_ranks

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--device", "cpu", "--train-iters", "3"]


def _train(flags, before=None):
    t = Trainer(parse_args(FLAGS + flags))
    try:
        if before:
            before(t)
        t.train()
    finally:
        t.close()


def test_line_every_log_interval(capsys):
    _train(["--log-straggler", "--straggler-ctrlr-port", str(free_port())])
    lines = [line for line in capsys.readouterr().out.splitlines() if "MnRtt/Rnk:" in line]
    assert len(lines) == 3 and all("ms/0 | MxRtt/Rnk:" in line and "TF/0 | MxEtpt/Rnk:" in line for line in lines)


def test_switch_turns_it_on(capsys):
    port = free_port()

    def switch(_trainer):
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            reply = c.recv(1024).decode()
        assert reply.startswith("HTTP/1.0 200 OK") and "Will turn StragglerDetector ON" in reply
    _train(["--log-straggler", "--disable-straggler-on-startup", "--straggler-ctrlr-port", str(port)], switch)
    out = capsys.readouterr().out
    assert " Toggling StragglerDetector State ON" in out
    assert out.count("MnRtt/Rnk:") == 2  # off in the first interval (the switch applies at its end)


def test_flags_need_log_straggler():
    with pytest.raises(ConfigError, match="--straggler-minmax-count: no effect without --log-straggler"):
        parse_args(FLAGS + ["--straggler-minmax-count", "4"])


def _two_ranks(rank, world, port):
    """DP 2: rank 1's forward steps sleep 400 ms (more than a busy machine's pauses of the other rank); the output
    each rank printed."""
    import contextlib
    import io
    t = Trainer(parse_args(FLAGS + ["--log-straggler", "--straggler-ctrlr-port", str(port), "--global-batch-size",
                                    "4"], world_size=2))
    step = t.forward_step

    def slow(*a, **k):
        if rank == 1:
            time.sleep(0.4)
        return step(*a, **k)
    t.forward_step = slow
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            t.train()
    finally:
        t.close()
    return buf.getvalue()


def test_the_slow_rank_is_named(tmp_path):
    outs = run_ranks(2, _two_ranks, free_port(), tmp_dir=tmp_path)
    lines = [line for line in outs[0].splitlines() if "MnRtt/Rnk:" in line]
    assert len(lines) == 3 and not any("MnRtt" in line for line in outs[1].splitlines())
    # The first interval also holds each rank's one-time warm-up (rank 0's can outweigh the sleep on a busy
    # machine), so the slow rank is checked in the steady intervals.
    assert all("ms/1 | MnEtpt/Rnk:" in line and "TF/1 | MxEtpt/Rnk:" in line for line in lines[1:]), lines


def test_record_memory_history(monkeypatch, tmp_path):
    """--record-memory-history (Megatron's): on a CPU run a one-line error; on CUDA (the allocator calls
    stubbed here) the recording starts before the model on the profiled ranks only, an OOM dumps
    <base>_oom_rank_<r><ext>, and each log line dumps <base>_<r><ext>."""
    import torch

    from paratron.train import watch
    with pytest.raises(ConfigError, match="--record-memory-history records the CUDA caching allocator"):
        parse_args(FLAGS + ["--record-memory-history"])
    with pytest.raises(ConfigError, match="--memory-snapshot-path has no effect without --record-memory-history"):
        parse_args(FLAGS + ["--memory-snapshot-path", "x.pickle"])
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", lambda fn: calls.append(("oom", fn)),
                        raising=False)  # (not in CPU builds)
    log = SimpleNamespace(record_memory_history=True, memory_snapshot_path=str(tmp_path / "mem.pickle"),
                          profile_ranks=[1])
    assert not watch.record_memory_history(log, 0) and calls == []  # rank 0 is not profiled
    assert watch.record_memory_history(log, 1)
    assert calls[0] == ("record", {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 100_000})
    calls[1][1](0, 0, 0, 0)  # the OOM observer
    watch.dump_memory_snapshot(log, 1)
    assert [c[1] for c in calls[2:]] == [str(tmp_path / "mem_oom_rank_1.pickle"), str(tmp_path / "mem_1.pickle")]
