"""Sharded checkpoints on one process: files and manifest, integrity checks with fallback, the safe
index reader, async save, retention, --finetune / --no-load-optim / --ckpt-step, and a SIGKILL in
the middle of a save."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratron.checkpoint import sharded
from paratron.config import parse_args
from paratron.train.loop import Trainer, pretrain
from tests.unit.test_train import ROOT, TINY, losses_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def train_and_save(tmp_path: Path, iters: int = 4, *extra: str) -> Path:
    """``iters`` iterations of a 6-iteration run (the schedule the tests resume with), saved every 2."""
    root = tmp_path / "ck"
    pretrain(parse_args(TINY + ["--train-iters", "6", "--exit-interval", str(iters), "--save-interval", "2",
                                "--save", str(root), "--eval-iters", "0", *extra]))
    return root


def flip_byte(path: Path, at: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_layout_and_manifest(tmp_path):
    root = train_and_save(tmp_path)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    d = root / "iter_0000004"
    names = sorted(p.name for p in d.iterdir())
    assert names == [".metadata", "__0_0.distcp", "common.json", "metadata.json"]
    manifest = json.loads((d / "metadata.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "common.json"]
    assert manifest["files"]["__0_0.distcp"]["size"] == (d / "__0_0.distcp").stat().st_size
    assert not list(root.glob(".iter_*"))  # no partial directory left
    common = json.loads((d / "common.json").read_text())
    assert common["iteration"] == 4 and common["consumed_samples"] == 16 and common["optimizer"]["step"] == 4
    shapes = sharded.tensor_shapes(d)
    assert shapes["model.embedding.word_embeddings.weight"][0] == (256, 64)
    assert shapes["optimizer.exp_avg.decoder.layers.1.mlp.linear_fc2.weight"][0] == (64, 256)
    assert shapes["rng.torch"][0][0] == 1  # [ranks, state bytes]


@pytest.mark.parametrize("damage", ["flip_shard", "truncate_shard", "truncate_index", "flip_common",
                                    "drop_manifest"])
def test_damaged_latest_falls_back_to_previous_with_a_warning(tmp_path, capsys, damage):
    root = train_and_save(tmp_path)
    d = root / "iter_0000004"
    target = {"flip_shard": "__0_0.distcp", "truncate_shard": "__0_0.distcp", "truncate_index": ".metadata",
              "flip_common": "common.json", "drop_manifest": "metadata.json"}[damage]
    path = d / target
    if damage.startswith("flip"):
        flip_byte(path, 5)
    elif damage.startswith("truncate"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()
    capsys.readouterr()
    t = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root), "--eval-iters", "0"]))
    out = capsys.readouterr().out
    assert t.iteration == 2, out
    assert f"WARNING: {path}" in out and "falling back to" in out and str(root / "iter_0000002") in out


def test_explicit_damaged_iteration_is_a_one_line_error(tmp_path):
    root = train_and_save(tmp_path)
    flip_byte(root / "iter_0000002" / "__0_0.distcp")
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--train-iters", "6", "--load", str(root),
                        "--ckpt-step", "2", "--eval-iters", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "iter_0000002/__0_0.distcp is corrupted" in err[0], err
    # the undamaged latest still loads, and --ckpt-step picks an older iteration
    assert Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root)])).iteration == 4


def test_every_checkpoint_damaged_is_an_error_naming_the_file(tmp_path):
    root = train_and_save(tmp_path)
    for it in (2, 4):
        flip_byte(root / f"iter_{it:07d}" / "__0_0.distcp")
    with pytest.raises(sharded.CheckpointError, match=r"no complete checkpoint .*iter_0000004/__0_0.distcp"):
        Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root)]))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_index_reader_refuses_arbitrary_objects(tmp_path):
    root = train_and_save(tmp_path, 2)
    d = root / "iter_0000002"
    (d / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(sharded.CheckpointError, match=r"\.metadata .*posix\.system is not allowed"):
        sharded.tensor_shapes(d)
    assert not (d / "pwned").exists() and not Path("pwned").exists()


def test_async_save_writes_the_state_of_its_iteration(tmp_path):
    """Training goes on while the background save runs; the checkpoint holds iteration 2's state,
    identical to a synchronous save of the same run."""
    flags = TINY + ["--train-iters", "4", "--eval-iters", "0"]
    a = Trainer(parse_args(flags + ["--save", str(tmp_path / "async"), "--async-save"]))
    losses_of(a, 2)
    a.save()
    assert a.pending_save is not None
    losses_of(a, 2)  # changes every parameter while the write may still run
    a.wait_for_save()
    s = Trainer(parse_args(flags + ["--save", str(tmp_path / "sync")]))
    losses_of(s, 2)
    s.save()
    got = sharded.load_full(tmp_path / "async" / "iter_0000002")
    ref = sharded.load_full(tmp_path / "sync" / "iter_0000002")
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_async_save_from_the_command_line_finishes_before_exit(tmp_path):
    root = tmp_path / "ck"
    result = pretrain(parse_args(TINY + ["--train-iters", "5", "--save-interval", "2", "--save", str(root),
                                         "--async-save", "--eval-iters", "0"]))
    assert result["iteration"] == 5
    assert sharded.complete_iterations(root) == [5, 4, 2]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"
    sharded.verify_checkpoint(root / "iter_0000005")


def test_keep_last_k_checkpoints(tmp_path):
    root = tmp_path / "ck"
    pretrain(parse_args(TINY + ["--train-iters", "5", "--save-interval", "1", "--save", str(root),
                                "--ckpt-keep-last", "2", "--eval-iters", "0"]))
    kept = sorted(p.name for p in root.iterdir() if p.name != "loss.png")
    assert kept == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt", "tokenizer"]


def test_finetune_and_no_load_optim(tmp_path):
    root = train_and_save(tmp_path)
    ref = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root)]))
    ft = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root), "--finetune"]))
    assert ft.iteration == 0 and ft.consumed_samples == 0 and not ft.optimizer.adam.state
    nopt = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root), "--no-load-optim"]))
    assert nopt.iteration == 4 and not nopt.optimizer.adam.state
    for a, b, c in zip(ref.model.module.parameters(), ft.model.module.parameters(), nopt.model.module.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert ref.optimizer.adam.state and int(next(iter(ref.optimizer.adam.state.values()))["step"]) == 4


def test_pretrained_checkpoint_fine_tunes_until_load_has_one(tmp_path, capsys):
    """Megatron's --pretrained-checkpoint: with nothing under --load the run starts from the pretrained weights (as
    --finetune: iteration 0, fresh optimizer); once it has saved under --load, a restart resumes from there."""
    pretrained = train_and_save(tmp_path)
    ref = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(pretrained), "--finetune"]))
    mine = tmp_path / "sft"
    flags = TINY + ["--train-iters", "6", "--load", str(mine), "--save", str(mine), "--pretrained-checkpoint",
                    str(pretrained)]
    ft = Trainer(parse_args(flags))
    assert "fine-tuning from --pretrained-checkpoint" in capsys.readouterr().out
    assert ft.iteration == 0 and ft.consumed_samples == 0 and not ft.optimizer.adam.state
    assert all(torch.equal(a, b) for a, b in zip(ref.model.module.parameters(), ft.model.module.parameters()))
    ft.train_step()
    ft.train_step()
    ft.save()
    ft.close()
    again = Trainer(parse_args(flags))
    assert again.iteration == 2 and again.optimizer.adam.state  # resumed from --load, not the pretrained weights
    assert all(torch.equal(a, b) for a, b in zip(ft.model.module.parameters(), again.model.module.parameters()))
    alone = Trainer(parse_args(TINY + ["--train-iters", "6", "--pretrained-checkpoint", str(pretrained)]))  # no --load
    assert alone.iteration == 0 and all(torch.equal(a, b) for a, b in zip(ref.model.module.parameters(),
                                                                        alone.model.module.parameters()))
    with pytest.raises(sharded.CheckpointError, match="nor in --pretrained-checkpoint"):
        Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(tmp_path / "none"), "--pretrained-checkpoint",
                                   str(tmp_path / "none2")]))
    from paratron.train.resolve import parse_args as parse_for_a_run  # (reads the checkpoint's config)
    shaped = parse_for_a_run(TINY + ["--train-iters", "6", "--hidden-size", "64", "--load", str(tmp_path / "none"),
                                     "--pretrained-checkpoint", str(pretrained), "--use-checkpoint-args"])
    assert shaped.model.hidden_size == ref.cfg.model.hidden_size  # the pretrained checkpoint's model


def test_bf16_checkpoint_loads_into_fp32_from_its_masters(tmp_path):
    """Switching precision loses nothing: fp32 weights come from the saved fp32 masters."""
    root = train_and_save(tmp_path, 2, "--bf16")
    masters = sharded.load_full(root / "iter_0000002", ["optimizer.fp32_param.decoder.layers.0.mlp.linear_fc1.weight"])
    t = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root)]))
    w = dict(t.model.module.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, masters["optimizer.fp32_param.decoder.layers.0.mlp.linear_fc1.weight"])


def test_missing_checkpoint_with_exit_flag_is_an_error(tmp_path):
    with pytest.raises(sharded.CheckpointError, match="no checkpoint found"):
        Trainer(parse_args(TINY + ["--train-iters", "2", "--load", str(tmp_path / "none"),
                                   "--exit-on-missing-checkpoint"]))


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Kill the process while iteration 4's checkpoint is being written: latest stays 2, the partial
    directory is ignored, and resuming from iteration 2 works."""
    root = tmp_path / "ck"
    flags = [*TINY, "--hidden-size", "512", "--num-attention-heads", "8", "--num-layers", "4",
             "--ffn-hidden-size", "2048", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "4", "--save-interval",
             "2", "--save", str(root), "--eval-iters", "0"]
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *flags], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    partial = root / ".iter_0000004.partial"
    deadline = time.time() + 240
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0]
    assert partial.exists() and proc.returncode == -signal.SIGKILL, out[-2000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (root / "iter_0000004").exists()
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *flags, "--load", str(root)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "at iteration 2 " in r.stdout and "iteration        4/       4" in r.stdout, r.stdout[-2000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4" and not partial.exists()


def test_padded_vocabulary_may_differ_between_layouts(tmp_path):
    """Vocabulary padding depends on TP (--make-vocab-size-divisible-by x TP): a checkpoint padded to
    384 rows loads into a model padded to 512 (rows it lacks become zeros) and back."""
    base = list(TINY)
    base[base.index("--vocab-size") + 1] = "300"
    root = tmp_path / "ck"
    a = Trainer(parse_args(base + ["--train-iters", "4", "--make-vocab-size-divisible-by", "128", "--save", str(root)]))
    losses_of(a, 2)
    a.save()
    b = Trainer(parse_args(base + ["--train-iters", "4", "--make-vocab-size-divisible-by", "512", "--load", str(root),
                                "--save", str(root)]))
    wa = a.model.module.embedding.word_embeddings.weight
    wb = b.model.module.embedding.word_embeddings.weight
    assert wa.shape[0] == 384 and wb.shape[0] == 512
    assert torch.equal(wb[:384], wa) and not wb[384:].any()
    m = next(s for p, s in b.optimizer.adam.state.items() if p.shape[0] == 512)
    assert m["exp_avg"][384:].abs().sum() == 0 and m["exp_avg"][:384].abs().sum() > 0
    b.save()
    c = Trainer(parse_args(base + ["--train-iters", "4", "--make-vocab-size-divisible-by", "128", "--load", str(root)]))
    assert torch.equal(c.model.module.embedding.word_embeddings.weight, wa)


def test_a_per_rank_checkpoint_of_an_older_paratron_is_a_clear_error(tmp_path):
    root = tmp_path / "ck"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "iter_0000003" / "rank_00000.pt").write_bytes(b"old")
    (root / "iter_0000003" / "metadata.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(sharded.CheckpointError, match="per-rank checkpoint .* older paratron"):
        Trainer(parse_args(TINY + ["--train-iters", "2", "--load", str(root)]))


def test_fp32_checkpoint_gives_a_bf16_run_fp32_masters(tmp_path):
    """The weights and the masters of a bf16 run both come from the fp32 tensor of the checkpoint:
    the masters keep its full precision, the weights are its bf16 rounding."""
    root = train_and_save(tmp_path, 2)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    saved = sharded.load_full(root / "iter_0000002", [f"model.{name}"])[f"model.{name}"]
    t = Trainer(parse_args(TINY + ["--train-iters", "6", "--load", str(root), "--bf16"]))
    params = dict(t.model.module.named_parameters())
    master = next(m for p, m in zip(t.optimizer.params, t.optimizer.masters) if p is params[name])
    assert master.dtype == torch.float32 and torch.equal(master, saved)
    assert torch.equal(params[name], saved.bfloat16())
