"""--fine-grained-activation-offloading on CUDA (paratron/model/activation_offload.py): the side-stream copies to
pinned host memory and the prefetched reloads give the losses and weights of training without offloading, and the
device memory at the end of a forward (what backward will need) is lower by about what went to the host."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLAGS = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size", "1024",
         "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "4", "--global-batch-size",
         "8", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--lr", "1e-3",
         "--train-iters", "4", "--eval-iters", "0", "--bf16", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--num-experts", "4", "--moe-grouped-gemm", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--device", "cuda", "--seed", "3"]
OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "qkv_linear", "core_attn",
           "attn_proj", "mlp_norm", "expert_fc1", "moe_act", "--min-offloaded-tensor-size", "1024"]


def _train(flags):
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    t = Trainer(parse_args(flags))
    losses = [(r[0] / r[1]).item() for r, _, _ in (t.train_step() for _ in range(3))]
    return t, losses, [p.detach().clone() for m in t.models for p in m.parameters()]


def _forward_memory(t) -> int:
    """Bytes allocated on the device once a training forward has run, before its backward."""
    model = t.models[0].module
    tokens = torch.randint(0, 1024, (4, 512), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(tokens, labels=tokens).float().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held


def test_offloading_trains_as_without_and_holds_less():
    ref, want, ref_params = _train(FLAGS)
    ref_held = _forward_memory(ref)
    del ref
    t, got, params = _train(FLAGS + OFFLOAD)
    assert got == want, (got, want)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    held = _forward_memory(t)
    moved = t.models[0].module.decoder.offloader.offloaded_bytes
    assert moved > 0 and held < ref_held, (held, ref_held, moved)
