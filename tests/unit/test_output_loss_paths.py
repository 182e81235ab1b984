"""--no-fused-output-loss (logits, then the vocabulary-parallel cross-entropy) trains the same model as the fused
output layer + loss: the same losses over a few steps, tied and untied (the untied output layer's gradient was lost
on the plain path when it went to main_grad)."""
import pytest

from paratron.config import parse_args
from paratron.train.loop import Trainer

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
         "--lr", "1e-2", "--train-iters", "4", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
         "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _losses(flags):
    t = Trainer(parse_args(FLAGS + flags))
    try:
        return [float(r[0] / r[1]) for r, _, _ in (t.train_step() for _ in range(4))]
    finally:
        t.close()


@pytest.mark.parametrize("tie", [[], ["--untie-embeddings-and-output-weights"]])
def test_plain_output_loss_trains_as_the_fused_one(tie):
    fused, plain = _losses(tie), _losses(tie + ["--no-fused-output-loss"])
    assert plain == pytest.approx(fused, rel=1e-5, abs=1e-6)
