"""Gradient-accumulation fusion on CUDA (paratron/parallel/linear.py, kernels/accumulate.py): the bf16 x bf16 -> fp32
in-place GEMM and the de-interleaving Triton add against torch, and a compiled bf16 llama-shaped run (gated
MLP, FlashAttention where installed) with the fusion against --no-gradient-accumulation-fusion."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fused_wgrad_gemm_and_deinterleaved_add_match_torch():
    from paratron.kernels import accumulate as ga
    g = torch.Generator(device="cuda").manual_seed(0)
    dy, x = (torch.randn(4096, n, device="cuda", generator=g).bfloat16() for n in (768, 512))
    acc = torch.randn(768, 512, device="cuda", generator=g)
    want = acc + dy.float().t() @ x.float()
    ga.wgrad_accumulate(acc, dy, x, False)
    assert ((acc - want).norm() / want.norm()).item() < 1e-5  # fp32 output: no bf16 rounding
    acc2 = torch.randn(768, 512, device="cuda", generator=g)
    product = dy.t() @ x  # what the interleaved path adds, in bf16
    want2 = acc2 + torch.cat([product[0::2], product[1::2]]).float()
    ga.wgrad_accumulate(acc2, dy, x, True)
    assert torch.equal(acc2, want2)


def test_embedding_gradient_added_by_atomics_matches_index_add():
    from paratron.kernels import accumulate as ga
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 50, (8192,), device="cuda", generator=g)  # many repeats
    dy = torch.randn(8192, 2048, device="cuda", generator=g).bfloat16()
    acc = torch.randn(64, 2048, device="cuda", generator=g)
    want = acc.clone().index_add_(0, ids, dy.float())
    ga.embedding_accumulate(acc, ids, dy)
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-4)  # fp32 sums in another order


def test_output_layer_gradient_accumulates_into_the_transposed_main_grad():
    from paratron.parallel.cross_entropy import _weight_grad
    g = torch.Generator(device="cuda").manual_seed(0)
    xg = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    d = torch.randn(4096, 3000, device="cuda", generator=g).bfloat16()
    w = torch.empty(3000, 512, device="cuda", dtype=torch.bfloat16)
    main = torch.randn(3000, 512, device="cuda", generator=g)
    want = main + (xg.float().t() @ d.float()).t()
    placeholder = _weight_grad(xg, d, main, w)
    assert placeholder.shape == w.shape and main.is_contiguous()
    assert ((main - want).norm() / want.norm()).item() < 1e-5  # fp32 output: no bf16 rounding


def test_compiled_bf16_run_with_the_fusion_matches_the_unfused_run():
    from paratron.config import parse_args
    from paratron.parallel.linear import fused_wgrad
    from paratron.train.loop import Trainer
    flags = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "512", "--swiglu", "--disable-bias-linear",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seq-length", "256",
             "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--lr", "1e-3", "--train-iters", "4",
             "--bf16", "--eval-iters", "0", "--device", "cuda", "--torch-compile", "--seed", "3",
             "--untie-embeddings-and-output-weights"]

    def run(extra):
        t = Trainer(parse_args(flags + extra))
        fused = sum(fused_wgrad(p) for p in t.models[0].module.parameters())
        losses = [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(4))]
        t.close()
        return fused, losses
    (fused, got), (plain, want) = run([]), run(["--no-gradient-accumulation-fusion"])
    assert fused == 10 and plain == 0  # 4 linear layers x 2 layers + the untied word embedding and output layer
    assert got[0] == want[0]  # the first forward does not depend on gradients
    # afterwards the fused run skips one bf16 rounding of each micro-batch's weight gradient
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-2, (got, want)
