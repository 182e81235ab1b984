"""Megatron's logging and runtime flags, run for real (issue 19): TensorBoard tags read back with
tensorboard's event reader, W&B offline files, --deterministic-mode, --manual-gc, --no-mmap-bin-files,
--dist-ckpt-strictness, --use-checkpoint-args."""
import gc
import math

import numpy as np
import pytest
import torch

from paratron.checkpoint.pieces import CheckpointError, Piece
from paratron.checkpoint.strictness import apply_strictness, mismatches
from paratron.train.resolve import parse_args
from paratron.train.loop import Trainer, pretrain
from paratron.train.runtime import GarbageCollection

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "3e-3", "--num-workers", "0",
        "--log-interval", "1", "--seed", "5"]
MEGATRON_TAGS = {
    "lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples",
    "loss-scale", "loss-scale vs samples", "grad-norm", "grad-norm vs samples", "params-norm", "params-norm vs samples",
    "num-zeros", "num-zeros vs samples", "world-size", "iteration-time", "throughput", "mem-reserved-bytes",
    "mem-allocated-bytes", "mem-max-allocated-bytes", "forward-backward-time", "all-grads-sync-time", "optimizer-time",
    "batch-generator-time", "lm loss validation", "lm loss validation vs samples", "lm loss validation ppl",
    "lm loss validation ppl vs samples"}


def read_scalars(path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_event_files_hold_megatrons_tags(tmp_path, capsys):
    flags = TINY + ["--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--tensorboard-dir",
                    str(tmp_path / "tb"), "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--timing-log-level",
                    "2", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-params-norm",
                    "--log-throughput", "--log-world-size-to-tensorboard", "--manual-gc", "--manual-gc-interval", "1",
                    "--untie-embeddings-and-output-weights"]
    result = pretrain(parse_args(flags))
    tags = read_scalars(tmp_path / "tb")
    assert MEGATRON_TAGS <= set(tags), sorted(MEGATRON_TAGS - set(tags))
    printed = [float(x) for x in __import__("re").findall(r"lm loss: ([0-9.E+-]+)", capsys.readouterr().out)]
    assert [round(v, 4) for _, v in tags["lm loss"]] == [round(v, 4) for v in printed]  # per-iteration values
    assert [s for s, _ in tags["lm loss"]] == [1, 2, 3] and [s for s, _ in tags["lm loss vs samples"]] == [4, 8, 12]
    assert [v for _, v in tags["batch-size"]] == [4, 4, 4]
    (_, valid), (_, ppl) = tags["lm loss validation"][-1], tags["lm loss validation ppl"][-1]
    assert abs(ppl - math.exp(valid)) <= 1e-3 * ppl
    model = result["trainer"].model.module  # the last step's gradients are still in the buffer
    zeros = sum(int((p.main_grad == 0).sum()) for p in model.parameters())
    assert tags["num-zeros"][-1][1] == zeros > 0  # unused embedding rows have zero gradients
    assert gc.isenabled()  # --manual-gc turned it back on at the end


def test_wandb_offline_run_tensorboard_interval_and_loss_scale_switch(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    pretrain(parse_args(TINY + ["--train-iters", "4", "--eval-iters", "0", "--tensorboard-dir", str(tmp_path / "tb"),
                                "--tensorboard-log-interval", "2", "--no-log-loss-scale-to-tensorboard",
                                "--wandb-project", "p", "--wandb-exp-name", "tiny", "--wandb-save-dir",
                                str(tmp_path / "wb")]))
    tags = read_scalars(tmp_path / "tb")
    assert [s for s, _ in tags["learning-rate"]] == [2, 4] and "loss-scale" not in tags
    assert "num-zeros" not in tags and "iteration-time" not in tags  # not asked for
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


def test_deterministic_mode_turns_on_deterministic_kernels():
    try:
        Trainer(parse_args(TINY + ["--train-iters", "1", "--deterministic-mode"]))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_manual_gc_collects_on_its_interval():
    cfg = parse_args(TINY + ["--train-iters", "1", "--manual-gc", "--manual-gc-interval", "2"])
    collector = GarbageCollection(cfg.train)
    try:
        assert not gc.isenabled() and collector.collections == 1
        for it in range(1, 6):
            collector.after_step(it)
        collector.around_eval()
        assert collector.collections == 1 + 2 + 1
    finally:
        collector.close()
    assert gc.isenabled()


def test_no_mmap_bin_files_reads_the_same_tokens(tmp_path):
    from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in (5, 1, 17, 9)]
    with IndexedDatasetWriter(str(tmp_path / "d"), dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d)
    mapped, read = IndexedDataset(str(tmp_path / "d")), IndexedDataset(str(tmp_path / "d"), mmap_bin=False)
    assert not isinstance(read._bin, np.memmap) and isinstance(mapped._bin, np.memmap)
    for i, d in enumerate(docs):
        assert np.array_equal(read[i], d) and np.array_equal(read.get(i, 1, 2), mapped.get(i, 1, 2))
        assert np.array_equal(read.document(i), mapped.document(i))


def _pieces(*keys):
    return [Piece(k, (2,), (0,), torch.zeros(2)) for k in keys]


def test_dist_ckpt_strictness_of_each_value():
    pieces, saved = _pieces("model.a", "model.b"), ["model.a", "model.c", "optimizer.x"]
    assert mismatches(pieces, saved) == (["model.b"], ["model.c"])  # optimizer.x: not a kind this load reads
    assert apply_strictness(pieces, saved, "assume_ok_unexpected", print) == pieces
    said = []
    kept = apply_strictness(pieces, saved, "log_all", said.append)
    assert [p.key for p in kept] == ["model.a"] and "model.b" in said[0] and "model.c" in said[0]
    assert "model.c" not in apply_strictness(pieces, saved, "log_unexpected", said.append) and "1 tensors" in said[1]
    quiet = []
    assert [p.key for p in apply_strictness(pieces, saved, "ignore_all", quiet.append)] == ["model.a"] and not quiet
    with pytest.raises(CheckpointError, match="raise_unexpected: 1 tensors the run needs"):
        apply_strictness(pieces, saved, "raise_unexpected", print)


def test_strictness_and_checkpoint_args_on_a_real_checkpoint(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    pretrain(parse_args(TINY + ["--train-iters", "1", "--eval-iters", "0", "--save", ck]))
    untied = TINY + ["--train-iters", "2", "--eval-iters", "0", "--load", ck, "--untie-embeddings-and-output-weights",
                    "--override-opt_param-scheduler"]
    with pytest.raises(CheckpointError, match="output"):
        Trainer(parse_args(untied))
    # the model check refuses another model first; on purpose, the strictness decides what is loaded
    trainer = Trainer(parse_args(untied + ["--dist-ckpt-strictness", "log_unexpected", "--override-checkpoint-model-args"]))
    assert trainer.iteration == 1 and "the rest is loaded" in capsys.readouterr().out
    cfg = parse_args(TINY + ["--train-iters", "2", "--hidden-size", "64", "--num-layers", "3", "--load", ck,
                             "--use-checkpoint-args"])
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (32, 2)  # the checkpoint's model
    fresh = parse_args(TINY + ["--train-iters", "2", "--load", str(tmp_path / "none"), "--use-checkpoint-args"])
    assert fresh.model.hidden_size == 32
    with pytest.raises(Exception, match="--exit-on-missing-checkpoint"):
        parse_args(TINY + ["--train-iters", "2", "--load", str(tmp_path / "none"), "--use-checkpoint-args",
                           "--exit-on-missing-checkpoint"])


def test_an_early_stop_says_why(capsys):
    result = pretrain(parse_args(TINY + ["--train-iters", "3", "--eval-iters", "0", "--exit-interval", "1"]))
    assert result["iteration"] == 1 and result["exit_reason"] == "--exit-interval 1"
    assert " exiting after 1 iterations: --exit-interval 1" in capsys.readouterr().out


def test_demo_samples_keep_whole_lines_and_tokenizer_reports_its_size(tmp_path):
    from paratron.data.bpe_train import train_bpe_tokenizer, vocabulary_report
    from paratron.demo import whole_lines
    assert whole_lines("def f(x):\n    return x\n    ret", "length") == ["def f(x):", "    return x"]
    assert whole_lines("import os\n", "stop") == ["import os"] and whole_lines("import o", "stop") == ["import o"]
    (tmp_path / "c.txt").write_text("alpha beta gamma delta\n" * 50)
    path = train_bpe_tokenizer([str(tmp_path / "c.txt")], 32000, str(tmp_path / "t.json"))
    report = vocabulary_report(path, 32000, 2)
    import json
    spec = json.loads(open(path).read())
    assert f"{len(spec['model']['vocab'])} tokens, fewer than the 32000 asked for" in report
    assert f"only {len(spec['model']['merges'])} merges" in report


class _FakeNVML:
    """NVML's energy counter, standing in for a GPU's: each reading 2.5 J (2,500 mJ) more than the last."""

    def __init__(self):
        self.mj, self.shut, self.rise = 1_000_000, False, 2500

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert uuid.startswith("GPU-")
        return "handle"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.mj += self.rise
        return self.mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return 150_000  # mW

    def nvmlShutdown(self):
        self.shut = True


def test_log_energy_per_gpu_and_iteration(monkeypatch):
    """--log-energy: the counter's rise over a log window, per GPU and iteration, and the power over the window's
    time; on the log line as Megatron writes it. On the CPU the flag is one line naming the problem."""
    import types
    from paratron.train import energy
    from paratron.train.logger import format_train_line
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="1234-abcd"))
    lib = _FakeNVML()
    meter = energy.EnergyMeter(torch.device("cpu"), lib)
    joules, watts = meter.lap(iterations=5, seconds=0.5, world_size=1)
    assert (joules, watts) == (0.5, 5.0)  # 2.5 J over 5 iterations in 0.5 s
    paused = meter.pause()  # (an evaluation: its 2.5 J left out)
    meter.resume(paused)
    # (each reading of the stand-in adds 2.5 J: the window holds the pause's reading and the lap's, not the resume's)
    assert meter.lap(iterations=1, seconds=1.0, world_size=1) == (5.0, 5.0)
    # a window shorter than the counter's step: the power reading times its time, and the window's iterations and
    # time go with the next rise (7.5 J over 1 + 2 iterations and 0.5 + 1.0 s)
    lib.rise = 0
    assert meter.lap(iterations=1, seconds=0.5, world_size=1) == (75.0, 150.0)
    lib.rise = 7500
    assert meter.lap(iterations=2, seconds=1.0, world_size=1) == (2.5, 5.0)
    meter.close()
    assert lib.shut
    line = format_train_line(10, 20, 80, 100.0, 1.5, 1e-3, 8, 2.0, 1.0, None, 0, 0, 1000.0, None, None,
                             energy=(joules, watts))
    assert "| energy per GPU (J/iter/GPU): 0.5 | power per GPU (W/GPU): 5.0 |" in line
    with pytest.raises(Exception, match="--log-energy reads a GPU's energy counter; this run is on the CPU"):
        from paratron.train.resolve import parse_args as parse_for_a_run
        parse_for_a_run(TINY + ["--train-iters", "2", "--device", "cpu", "--log-energy"])


def test_evaluations_and_saves_are_not_in_the_log_lines_time(tmp_path, monkeypatch, capsys):
    """As Megatron's interval timer: the time per iteration on the log line leaves out evaluations and checkpoint
    saves (here an evaluation made to take 3 s inside a window of 2 iterations would add 1,500 ms to each; the
    first window also holds the warm-up, which a busy machine can stretch past a second)."""
    import re
    import time
    from paratron.train.evaluation import Evaluation
    slow = Evaluation._validate

    def validate(self, collector=None):
        time.sleep(3.0)
        return slow(self, collector)

    monkeypatch.setattr(Evaluation, "_validate", validate)
    pretrain(parse_args(TINY + ["--train-iters", "4", "--log-interval", "2", "--eval-interval", "1", "--eval-iters",
                                "1", "--save", str(tmp_path / "ck"), "--save-interval", "1"]))
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", capsys.readouterr().out)]
    assert len(ms) == 2 and ms[1] < 1000, ms
