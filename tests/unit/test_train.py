"""The training loop end to end on one process: loss falls, resume is bit-exact, the CLI behaves."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratron.config import parse_args
from paratron.train.loop import Trainer, pretrain

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "3e-3",
        "--num-workers", "0", "--eval-iters", "2", "--log-interval", "1", "--seed", "5"]


def losses_of(trainer: Trainer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        report, _, _ = trainer.train_step()
        out.append((report[0] / report[1]).item())
    return out


def test_loss_falls_on_tiny_preset(tmp_path):
    cfg = parse_args(["--config", "tiny", "--train-iters", "60", "--tensorboard-dir", str(tmp_path / "tb"),
                      "--eval-interval", "30"])
    result = pretrain(cfg)
    curve = [loss for _, loss in result["train_curve"]]
    assert curve[-1] < 0.8 * curve[0], curve
    assert result["valid_curve"] and result["plot"].is_file()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("extra", [[], ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                                        "rope", "--untie-embeddings-and-output-weights", "--bf16"],
                                   ["--optimizer", "muon", "--use-distributed-optimizer", "--decoupled-lr", "6e-3",
                                    "--apply-layernorm-1p", "--num-experts", "2", "--bf16"]])
def test_resume_is_bit_exact(tmp_path, extra):
    """2N steps straight == N steps, save, load in a fresh trainer, N more (losses and weights),
    with dropout on so the restored RNG state matters."""
    n = 3
    flags = TINY + ["--train-iters", str(2 * n), "--hidden-dropout", "0.1", "--attention-dropout", "0.1"] + extra
    straight = Trainer(parse_args(flags))
    ref = losses_of(straight, 2 * n)

    first = Trainer(parse_args(flags + ["--save", str(tmp_path / "ck")]))
    got = losses_of(first, n)
    first.save()
    second = Trainer(parse_args(flags + ["--load", str(tmp_path / "ck")]))
    assert second.iteration == n and second.consumed_samples == n * 4
    got += losses_of(second, n)
    assert got == ref
    for (name, a), b in zip(straight.model.module.named_parameters(), second.model.module.parameters()):
        assert torch.equal(a, b), name
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == str(n)


def test_load_from_empty_dir_starts_from_scratch(tmp_path, capsys):
    t = Trainer(parse_args(TINY + ["--train-iters", "2", "--load", str(tmp_path / "none")]))
    assert t.iteration == 0
    assert "no checkpoint found" in capsys.readouterr().out


def test_exit_interval_saves_first(tmp_path):
    cfg = parse_args(TINY + ["--train-iters", "10", "--exit-interval", "3", "--save", str(tmp_path / "ck")])
    result = pretrain(cfg)
    assert result["iteration"] == 3
    assert (tmp_path / "ck" / "iter_0000003" / "metadata.json").is_file()


def test_fp16_loss_scale_is_dynamic(tmp_path):
    t = Trainer(parse_args(TINY + ["--train-iters", "4", "--fp16", "--initial-loss-scale", "65536"]))
    losses_of(t, 4)
    assert t.optimizer.loss_scale <= 65536  # 2^16 may overflow in fp16: backs off, never grows in 4 steps


def run_cli(*args, timeout=240):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # (~25 s, a 50k-vocabulary loss head; the log line's fields are checked in-process below)
def test_cli_acceptance_command_prints_megatron_lines():
    from tests.parallel.cli import run_script
    r = run_script(1, "pretrain_gpt.py", ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                          "--seq-length", "128", "--max-position-embeddings", "128",
                                          "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20",
                                          "--lr", "1e-3", "--mock-data", "--log-interval", "5", "--eval-iters", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if re.search(r"iteration\s+\d+/\s*20 \|", ln)]
    assert len(lines) == 4
    for ln in lines:
        assert "throughput per GPU (TFLOP/s/GPU):" in ln and "lm loss:" in ln and "consumed samples:" in ln


def test_cli_misspelt_flag_is_one_line_error():
    r = run_cli("pretrain_gpt.py", "--num-layer", "2", "--lr", "1e-3", "--mock-data", "--train-iters", "2")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--num-layer" in err[0] and "--num-layers" in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_paratron_module_entry_and_unknown_command():
    r = run_cli("-m", "paratron", "trian")
    assert r.returncode != 0 and "did you mean `paratron train`" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("-m", "paratron", "--help")
    assert r.returncode == 0 and "preprocess" in r.stdout


def test_loading_a_checkpoint_of_another_shape_is_a_one_line_error(tmp_path):
    from paratron.checkpoint.sharded import CheckpointError
    t = Trainer(parse_args(TINY + ["--train-iters", "1", "--save", str(tmp_path / "ck")]))
    t.save()
    with pytest.raises(CheckpointError, match="does not fit this model.*shape"):
        Trainer(parse_args(TINY + ["--train-iters", "1", "--hidden-size", "128", "--load", str(tmp_path / "ck"),
                                   "--override-checkpoint-model-args"]))  # (else the saved config is refused first)


def test_exit_check_all_reduces_only_when_ranks_can_disagree(monkeypatch):
    """Iteration-based exits are the same on every rank: no collective per step. --exit-duration-in-mins
    and --exit-signal-handler can differ between ranks: then the ranks agree through one all-reduce."""
    import signal
    import time
    from paratron.train import loop
    sigterm = signal.getsignal(signal.SIGTERM)  # --exit-signal-handler installs its own
    plain = Trainer(parse_args(TINY + ["--train-iters", "4", "--exit-interval", "3"]), data=(iter(()), None))
    others = [Trainer(parse_args(TINY + ["--train-iters", "4"] + flag), data=(iter(()), None))
              for flag in (["--exit-duration-in-mins", "60"], ["--exit-signal-handler"])]
    signal.signal(signal.SIGTERM, sigterm)
    calls = []
    monkeypatch.setattr(loop.dist, "is_initialized", lambda: True)  # as if there were several ranks
    monkeypatch.setattr(loop.dist, "all_reduce", lambda t, **kw: calls.append(t))
    assert [plain._should_exit(time.time()) for plain.iteration in (1, 2, 3, 4)] == [False, False, True, True]
    assert calls == []
    for t in others:
        t.iteration = 1
        assert not t._should_exit(time.time()) and len(calls) == 1
        calls.clear()
        t.iteration = 4  # the iteration count already ends the run on every rank
        assert t._should_exit(time.time()) and calls == []


@pytest.mark.parametrize("throughput", [False, True])
def test_log_throughput_writes_throughput_to_tensorboard(tmp_path, capsys, throughput):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = tmp_path / "tb"
    pretrain(parse_args(TINY + ["--train-iters", "2", "--eval-iters", "0", "--tensorboard-dir", str(tb)]
                        + (["--log-throughput"] if throughput else [])))
    assert "throughput per GPU (TFLOP/s/GPU):" in capsys.readouterr().out  # the log line always has it
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "lm loss" in tags
    assert ({"throughput TFLOP/s/GPU", "tokens per second per GPU"} <= tags) == throughput


def test_log_params_norm_prints_the_weights_norm(capsys):
    cfg = parse_args(TINY + ["--train-iters", "2", "--eval-iters", "0", "--log-params-norm"])
    result = pretrain(cfg)
    shown = [float(x) for x in re.findall(r"params norm: ([0-9.]+)", capsys.readouterr().out)]
    model = result["trainer"].model.module
    want = torch.sqrt(sum(p.detach().float().square().sum() for p in model.parameters())).item()
    assert len(shown) == 2 and abs(shown[-1] - want) <= 1e-3 * want, (shown, want)
    plain = parse_args(TINY + ["--train-iters", "1", "--eval-iters", "0"])
    pretrain(plain)
    assert "params norm" not in capsys.readouterr().out


def test_a_closed_trainer_releases_its_model_and_stops_its_data_workers():
    """The gradient hooks on the parameters (held from C++, unseen by the garbage collector) must not keep
    the data-parallel wrapper, the model and its weights alive once the trainer is gone. close() stops the
    data loaders' worker processes itself: the garbage collector would take 5 s for each (LoaderIterator)."""
    import gc
    import multiprocessing
    import weakref
    before = set(multiprocessing.active_children())
    flags = TINY[:TINY.index("--num-workers")] + TINY[TINY.index("--num-workers") + 2:]
    t = Trainer(parse_args(flags + ["--num-workers", "2", "--train-iters", "2"]))
    t.train_step()
    next(t.valid_iter)  # the validation stream starts its workers at its first batch
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 4  # 2 for training, 2 for validation
    ref = weakref.ref(next(t.models[0].module.parameters()))
    t.close()
    assert not any(w.is_alive() for w in workers)
    del t
    gc.collect()
    assert ref() is None
