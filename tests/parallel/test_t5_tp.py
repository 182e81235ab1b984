"""The tiny T5's logits under TP2 (with and without sequence parallelism) equal one rank's."""
import pytest
import torch

from paratron.model.t5 import T5Model
from tests.dist import run_ranks
from tests.parallel.t5_cases import batch, tiny_config, tp_logits


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_t5_logits_tp2(tmp_path, sp):
    enc, dec, pad = batch()
    want = T5Model(tiny_config(), 96)(enc, dec, pad).detach()
    got = run_ranks(2, tp_logits, sp, tmp_dir=tmp_path)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
