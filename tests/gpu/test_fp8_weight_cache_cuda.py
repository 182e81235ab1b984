"""The FP8 weight cache on the GPU (paratron/fp8/weights.py; skipped without CUDA): compiled training steps of two
micro-batches with the weights cast once per step (--kernel-fp8-weight-cache on) give the losses of the layers' own
casts (the default): dense tensorwise and blockwise, and an MoE model (its dense layers cached, the routed experts'
fused FP8 MLP casting its weights itself)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RUN = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
       "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--lr", "1e-3",
       "--train-iters", "4", "--bf16", "--eval-iters", "0", "--device", "cuda", "--torch-compile",
       "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-grouped-gemm",
       "--moe-permute-fusion"]


def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="Hopper")
@pytest.mark.parametrize("flags", [["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                                   ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
                                   ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", *MOE]],
                         ids=["tensorwise", "blockwise", "moe-fused"])
def test_cached_fp8_weights_train_as_the_layers_own_casts(flags):
    from paratron.config import parse_args
    from paratron.train.loop import Trainer

    def losses(more):
        t = Trainer(parse_args(RUN + flags + more))
        out = [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(4))]
        assert all(m.fp8.weight_cache is None for m in t.model.modules() if getattr(m, "fp8", None) is not None)
        return out

    cached, own = losses(["--kernel-fp8-weight-cache", "on"]), losses([])
    assert cached == pytest.approx(own, rel=2e-3), (cached, own)
    assert cached[-1] < cached[0], cached
