"""Batch-size ramp (--rampup-batch-size) and the data-parallel / precision flags' validation."""
import pytest
import torch

from paratron.config import ConfigError, parse_args, resolve_batch
from paratron.parallel.data import grad_buffer_dtype
from paratron.train.microbatches import MicroBatches

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--lr", "1e-3", "--mock-data", "--micro-batch-size", "2"]


def test_ramp_follows_megatron_schedule():
    # start 2, +2 per 12/3 = 4 samples, up to 8: sizes depend on the samples consumed before the step
    mb = MicroBatches(8, micro_batch_size=1, data_parallel_size=2, rampup_batch_size=[2, 2, 12])
    consumed, sizes = 0, []
    for _ in range(7):
        sizes.append(mb.global_batch(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 2, 4, 6, 8, 8, 8]
    assert [mb.num_microbatches(c) for c in (0, 4, 8, 14)] == [1, 2, 3, 4]
    assert mb.global_batch(12) == 8  # 12 / 4 = 3 increments: the full size at the ramp's end


def test_constant_batch_without_ramp():
    mb = MicroBatches(16, micro_batch_size=2, data_parallel_size=4)
    assert [mb.global_batch(c) for c in (0, 16, 10**6)] == [16, 16, 16]
    assert mb.num_microbatches(0) == 2
    assert mb.train_iters_for_samples(100) == 6


def test_train_samples_to_iterations_with_ramp():
    mb = MicroBatches(8, micro_batch_size=1, data_parallel_size=2, rampup_batch_size=[2, 2, 12])
    # ramp steps while consumed <= 12: 2,2,4,6 (consumed 14), then (100 - 14) // 8 = 10 full steps
    assert mb.train_iters_for_samples(100) == 4 + 10


def test_rampup_flag_parses_and_validates():
    cfg = parse_args(BASE + ["--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12"])
    assert cfg.train.rampup_batch_size == [2, 2, 12]
    resolve_batch(cfg, 1)
    with pytest.raises(ConfigError, match="multiples of --micro-batch-size"):
        resolve_batch(cfg, 2)  # START 2 is not a multiple of mbs 2 x dp 2
    with pytest.raises(ConfigError, match="multiple of INCREMENT"):
        parse_args(BASE + ["--train-iters", "5", "--global-batch-size", "8", "--rampup-batch-size", "2", "4", "12"])
    with pytest.raises(ConfigError, match="needs --global-batch-size"):
        parse_args(BASE + ["--train-iters", "5", "--rampup-batch-size", "2", "2", "12"])


@pytest.mark.parametrize("extra,needle", [
    (["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    (["--grad-reduce-in-bf16"], "needs --bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "mutually exclusive"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size"),
])
def test_dp_flag_errors(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(BASE + ["--train-iters", "5"] + extra)


@pytest.mark.parametrize("extra,dtype", [
    ([], torch.float32),
    (["--bf16"], torch.float32),
    (["--bf16", "--grad-reduce-in-bf16"], torch.bfloat16),
    (["--fp16"], torch.float16),  # Megatron: fp16 gradients unless --accumulate-allreduce-grads-in-fp32
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], torch.float32),
])
def test_gradient_buffer_dtype(extra, dtype):
    assert grad_buffer_dtype(parse_args(BASE + ["--train-iters", "5"] + extra)) == dtype


def test_eval_global_batch_size():
    """--eval-global-batch-size: an evaluation step's micro-batches, the validation split's samples,
    and a one-line error when it does not split over the micro-batches."""
    from types import SimpleNamespace

    from paratron.data.blended import train_valid_test_num_samples
    from paratron.train.loop import Trainer
    from tests.unit.test_train import TINY
    micro = MicroBatches(16, 2, 2, eval_global_batch_size=8)
    assert micro.eval_microbatches(0) == 2 and micro.num_microbatches(0) == 4
    tr = SimpleNamespace(global_batch_size=16, train_samples=None, train_iters=10, eval_iters=3, eval_interval=5,
                         eval_global_batch_size=8)
    assert train_valid_test_num_samples(tr) == [160, 3 * 3 * 8, 3 * 8]
    def served(flags) -> int:
        """Micro-batches one evaluation takes from the validation iterator."""
        trainer, count = Trainer(parse_args(TINY + ["--train-iters", "2", "--device", "cpu"] + flags)), []
        inner = trainer.valid_iter

        def counting():
            for b in inner:
                count.append(1)
                yield b
        trainer.valid_iter = counting()
        trainer.evaluate()
        trainer.close()
        return len(count)
    assert served(["--eval-global-batch-size", "2"]) == 2  # eval-iters 2 x one micro-batch of 2
    assert served([]) == 4  # x the global batch's two micro-batches
    with pytest.raises(ConfigError, match="--eval-global-batch-size 3 is not divisible by --micro-batch-size 2"):
        Trainer(parse_args(TINY + ["--train-iters", "2", "--eval-global-batch-size", "3", "--device", "cpu"]))
