"""--step-batch-size-schedule (Megatron's StepBatchsizeNumMicroBatchesCalculator) and
--save-retain-interval (Megatron's deletion of the previous non-retained checkpoint)."""
import re

import pytest
import torch

from paratron.checkpoint import sharded
from paratron.checkpoint.pieces import Piece
from paratron.checkpoint.retention import Retention
from paratron.config import ConfigError, parse_args
from paratron.config.batch_schedule import step_schedule
from paratron.train.loop import Trainer
from paratron.train.microbatches import MicroBatches

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--lr", "3e-3", "--num-workers", "0", "--eval-iters", "0",
         "--log-interval", "1", "--seed", "5"]
# thresholds in tokens / seq 32: 1 sample -> 2, 3 samples -> 4
SCHEDULE = ["--step-batch-size-schedule", "0:1 32:2 96:4"]


def megatron_iters(steps, train_samples):
    """Megatron's update_train_iters loop, step by step (the reference of the per-entry count)."""
    iters = consumed = 0
    while consumed < train_samples:
        consumed += [b for t, b in steps if t <= consumed][-1]
        iters += 1
    return iters


def test_schedule_parses_as_megatron():
    # 175B example: tokens with suffixes, turned into samples by // seq_length (2048)
    s = step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert s == [(0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536)]
    assert step_schedule("250K:8,0:4", None) == [(0, 4), (250000, 8)]  # commas, unsorted, samples without seq
    assert step_schedule("0:1k 1.5m:2K", 1) == [(0, 1000), (1500000, 2000)]
    for bad, match in (("16:4", "threshold 0"), ("0:4 10:8 15:16", "strictly increasing"), ("0:4 x:8", "not a number"),
                       ("0-4", "THRESHOLD:BATCH_SIZE"), ("0:0", "positive")):
        with pytest.raises(ConfigError, match=match):
            step_schedule(bad, 10)


def test_batch_sizes_and_train_iters_follow_the_schedule():
    mb = MicroBatches(2, 1, 2, steps=[(0, 2), (2, 4), (5, 8)])  # --global-batch-size: mbs x dp, as Megatron
    consumed, sizes = 0, []
    for _ in range(5):
        sizes.append(mb.global_batch(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 4, 8, 8, 8] and consumed == 30
    assert [mb.num_microbatches(c) for c in (0, 1, 2, 4, 5, 100)] == [1, 1, 2, 2, 4, 4]
    assert mb.eval_microbatches(100) == 1  # evaluation steps are --global-batch-size's (Megatron's eval default)
    steps = [(0, 16), (1000, 48), (1030, 64), (5000, 80)]
    m = MicroBatches(1, 1, 1, steps=steps)
    for n in (1, 16, 17, 999, 1000, 1001, 1040, 5000, 5001, 123457):
        assert m.train_iters_for_samples(n) == megatron_iters(steps, n), n
    walked = [0]
    for _ in range(200):
        walked.append(walked[-1] + m.global_batch(walked[-1]))
    assert [m.samples_for_iters(i) for i in range(200)] == walked[:200]


def test_schedule_flags_validate():
    cfg = parse_args(SMALL + SCHEDULE + ["--train-samples", "12"])
    assert cfg.train.train_iters == 5 and cfg.train.global_batch_size == 1  # Megatron: mbs x dp without the flag
    explicit = parse_args(SMALL + SCHEDULE + ["--train-iters", "3", "--global-batch-size", "4"])
    assert explicit.train.global_batch_size == 4  # equal to the final scheduled size: accepted
    for extra, match in ((["--global-batch-size", "16"], "final batch size is 4"),
                         (["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "4"], "mutually exclusive"),
                         (["--micro-batch-size", "3"], "not divisible by --micro-batch-size 3")):
        with pytest.raises(ConfigError, match=match):
            parse_args(SMALL + SCHEDULE + ["--train-iters", "3"] + extra)


def _run(root, iters, extra=(), capsys=None):
    trainer = Trainer(parse_args(SMALL + SCHEDULE + ["--train-iters", str(iters), "--save", str(root),
                                                     "--save-interval", "100"] + list(extra)))
    try:
        trainer.train()
    finally:
        trainer.close()
    out = capsys.readouterr().out
    rows = re.findall(r"iteration\s+(\d+)/.*?consumed samples:\s+(\d+).*?global batch size:\s+(\d+)"
                      r".*?lm loss: (\S+)", out)
    return [(int(i), int(c), int(g), float(l)) for i, c, g, l in rows]


def test_resume_mid_schedule_continues_sizes_and_samples(tmp_path, capsys):
    straight = _run(tmp_path / "a", 4, capsys=capsys)
    assert [(i, c, g) for i, c, g, _ in straight] == [(1, 1, 1), (2, 3, 2), (3, 7, 4), (4, 11, 4)]
    # Megatron saves when the micro-batch count changes (before steps 2 and 3), then at the end
    assert sharded.complete_iterations(tmp_path / "a") == [4, 2, 1]
    first = _run(tmp_path / "b", 4, ["--exit-interval", "2"], capsys=capsys)
    resumed = _run(tmp_path / "b", 4, ["--load", str(tmp_path / "b")], capsys=capsys)
    assert first + resumed == straight  # same sizes, consumed samples and losses (bit-exact on CPU)


# ---- --save-retain-interval ------------------------------------------------------------------------

def _save(root, it, keep):
    sharded.save(root, it, [Piece("x", (2,), (0,), torch.full((2,), float(it)))], {}, keep_last=keep)


def test_retain_interval_deletes_only_the_previous_non_retained(tmp_path):
    keep = Retention(retain_interval=4)
    _save(tmp_path, 3, Retention())  # written before (another run): not the latest when the next save comes
    _save(tmp_path, 1, Retention())  # the latest marker now names 1
    for it in (2, 4, 6, 8, 10):
        _save(tmp_path, it, keep)
    # after 2: 1 (previous) goes; after 4: 2 goes; after 6: 4 stays (a multiple); after 8: 6 goes; after 10: 8 stays
    assert sharded.complete_iterations(tmp_path) == [10, 8, 4, 3]
    _save(tmp_path, 7, keep)  # an older iteration saved again (a resume with --ckpt-step): 10 is newer, kept
    assert sharded.complete_iterations(tmp_path) == [10, 8, 7, 4, 3]


def test_retain_interval_with_keep_last_and_links(tmp_path):
    both = Retention(keep_last=1, retain_interval=3)
    for it in (1, 2, 3, 4, 5, 6, 7):
        _save(tmp_path, it, both)
    assert sharded.complete_iterations(tmp_path) == [7, 6, 3]  # the newest, and the multiples of 3
    assert Retention(keep_last=2).to_remove([9, 8, 7, 3], 8, 7) == [7, 3]  # never the newer 9 nor the saved 8
    link = tmp_path / "links"
    _save(link, 5, Retention())
    (link / "iter_0000006").symlink_to(link / "iter_0000005", target_is_directory=True)
    (link / "latest_checkpointed_iteration.txt").write_text("6")
    _save(link, 7, Retention(retain_interval=4))  # the previous latest (6) is a symbolic link: left alone
    assert (link / "iter_0000006").is_symlink() and (link / "iter_0000005").is_dir()


def test_retain_interval_flag(tmp_path):
    with pytest.raises(ConfigError, match="multiple of --save-interval 3"):
        parse_args(SMALL + ["--train-iters", "3", "--save", str(tmp_path), "--save-interval", "3",
                            "--save-retain-interval", "4"])
    trainer = Trainer(parse_args(SMALL + ["--train-iters", "5", "--global-batch-size", "1", "--save", str(tmp_path),
                                          "--save-interval", "1", "--save-retain-interval", "2"]))
    trainer.train()
    trainer.close()
    assert sharded.complete_iterations(tmp_path) == [5, 4, 2]
