"""Megatron's gradient-accumulation fusion (paratron/parallel/linear.py, kernels/accumulate.py): weight gradients added
to ``main_grad`` by the backward itself, against autograd's gradients and the unfused trainer."""
import pytest
import torch

from paratron.config import parse_args
from paratron.fp8 import FP8State, Recipe
from paratron.kernels import accumulate, quack_mlp as quack_kernels
from paratron.parallel import linear as ga
from paratron.parallel.linear import fused_wgrad, main_grad_of
from paratron.parallel.sharding import update_spec
from paratron.parallel.tensor import RowParallelLinear
from paratron.train.loop import Trainer


def _fused_weight(out_f, in_f, dtype=torch.float32):
    w = torch.nn.Parameter(torch.randn(out_f, in_f, dtype=dtype))
    w.main_grad = torch.zeros(out_f, in_f)
    update_spec(w, fuse_wgrad=True)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulate_adds_the_product_and_deinterleaves(dtype):
    torch.manual_seed(0)
    dy, x = torch.randn(9, 6, dtype=dtype), torch.randn(9, 4, dtype=dtype)
    acc = torch.randn(6, 4)
    want = acc + dy.float().t() @ x.float()
    accumulate.wgrad_accumulate(acc, dy, x, False)
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-5)
    acc2 = torch.randn(6, 4)
    # interleaved rows [g0, u0, g1, u1, g2, u2] -> [g0, g1, g2; u0, u1, u2]
    product = (dy.t() @ x).float()
    want2 = acc2 + torch.cat([product[0::2], product[1::2]])
    accumulate.wgrad_accumulate(acc2, dy, x, True)
    torch.testing.assert_close(acc2, want2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True)])
def test_fused_linear_puts_the_weight_gradient_in_main_grad(bias, residual):
    torch.manual_seed(1)
    w = _fused_weight(5, 3)
    b = torch.nn.Parameter(torch.randn(5)) if bias else None
    x = torch.randn(2, 4, 3, requires_grad=True)
    r = torch.randn(2, 4, 5, requires_grad=True) if residual else None
    ref_w = w.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_() if bias else None
    ref_x = x.detach().clone().requires_grad_()
    ref_r = r.detach().clone().requires_grad_() if residual else None
    for step in range(2):  # two micro-batches accumulate
        y = ga.linear(x, w, b, r)
        ref = torch.nn.functional.linear(ref_x, ref_w, ref_b) + (ref_r if residual else 0)
        torch.testing.assert_close(y, ref)
        g = torch.randn_like(y)
        y.backward(g)
        ref.backward(g)
    torch.testing.assert_close(w.main_grad, ref_w.grad)  # the whole sum, in main_grad
    assert w.grad is not None and w.grad.shape == w.shape  # a placeholder for autograd's hooks
    torch.testing.assert_close(x.grad, ref_x.grad)
    if bias:
        torch.testing.assert_close(b.grad, ref_b.grad)
    if residual:
        torch.testing.assert_close(r.grad, ref_r.grad)
    with torch.no_grad():  # no autograd: the plain matmul, main_grad untouched
        before = w.main_grad.clone()
        ga.linear(x, w, b, r)
    assert torch.equal(w.main_grad, before)


def test_gated_mlp_backward_adds_both_weight_gradients_to_main_grad():
    torch.manual_seed(2)
    h, f = 8, 4
    x = torch.randn(6, h, requires_grad=True)
    w1, w2 = _fused_weight(2 * f, h), _fused_weight(h, f)
    ref_w1, ref_w2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    g = torch.randn(6, h)
    quack_kernels.gated_mlp(x, w1, w2, main_grads=(main_grad_of(w1), main_grad_of(w2))).backward(g)
    quack_kernels.gated_mlp(x.detach(), ref_w1, ref_w2).backward(g)
    torch.testing.assert_close(w1.main_grad, ref_w1.grad)
    torch.testing.assert_close(w2.main_grad, ref_w2.grad)


def test_an_fp8_state_on_a_fused_weight_is_an_error():
    layer = RowParallelLinear(4, 4, bias=False)
    layer.weight.main_grad = torch.zeros(4, 4)
    update_spec(layer.weight, fuse_wgrad=True)
    layer.fp8 = FP8State(Recipe(format="e4m3", recipe="tensorwise", emulate=True))  # attached after DataParallel
    with pytest.raises(RuntimeError, match="before wrapping"):
        layer(torch.randn(2, 4))


SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--lr", "3e-3", "--num-workers", "0",
         "--eval-iters", "0", "--log-interval", "100", "--seed", "5", "--train-iters", "3", "--swiglu"]


def _train(extra):
    t = Trainer(parse_args(SMALL + extra))
    try:
        fused = {n for n, p in t.models[0].module.named_parameters() if fused_wgrad(p)}
        losses = [t.train_step()[0].tolist() for _ in range(3)]
        return fused, losses, {n: p.detach().clone() for n, p in t.models[0].module.named_parameters()}
    finally:
        t.close()


@pytest.mark.parametrize("untied", [False, True])
def test_trainer_with_fused_weight_gradients_equals_the_unfused_one(untied):
    extra = ["--untie-embeddings-and-output-weights"] if untied else []
    fused, losses, weights = _train(extra)
    plain, plain_losses, plain_weights = _train(extra + ["--no-gradient-accumulation-fusion"])
    # the attention's and MLP's four linear layers of each layer, and untied, the word embedding and the output
    # layer (tied, they are one tensor, which the embedding's lookup and the output layer's matmul both use
    # and which is left to autograd); not the norms
    assert fused == {f"decoder.layers.{i}.{m}.weight" for i in range(2) for m in
                     ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
                     } | ({"embedding.word_embeddings.weight", "output_layer.weight"} if untied else set())
    assert plain == set()
    assert losses == plain_losses  # fp32: the same sums
    for n in weights:
        torch.testing.assert_close(weights[n], plain_weights[n], rtol=1e-6, atol=1e-7)


def test_a_module_wrapped_again_without_the_fusion_accumulates_through_the_hook():
    import gc
    from paratron.model.layers import Attention, Parallel
    from paratron.parallel.data import DataParallel
    from paratron.parallel.dims import ParallelDims
    att = Attention(parse_args(SMALL).model, Parallel())
    w = att.linear_qkv.weight
    first = DataParallel(att, ParallelDims(), fuse_wgrad=True)
    assert fused_wgrad(w) and w in first.fused_wgrad
    del first
    gc.collect()  # (its hooks hold it weakly: they do nothing once it is gone)
    second = DataParallel(att, ParallelDims(), fuse_wgrad=False)
    assert not fused_wgrad(w) and not second.fused_wgrad
    x = torch.randn(3, 2, 32)
    att.linear_qkv(x).square().sum().backward()
    ref = w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x, ref).square().sum().backward()
    torch.testing.assert_close(w.main_grad, ref.grad)  # the hook added autograd's gradient, not a placeholder


def test_fused_embedding_adds_the_table_gradient_to_main_grad():
    from paratron.parallel.linear import embedding
    w = torch.randn(10, 4, requires_grad=True)
    w.main_grad = torch.ones(10, 4)
    update_spec(w, fuse_wgrad=True)
    ids = torch.tensor([[1, 3, 1], [9, 0, 1]])  # row 1 three times
    dy = torch.randn(2, 3, 4)
    out = embedding(ids, w)
    assert torch.equal(out, w.detach()[ids])
    out.backward(dy)
    ref = torch.ones(10, 4).index_add_(0, ids.flatten(), dy.reshape(-1, 4))
    torch.testing.assert_close(w.main_grad, ref)
    update_spec(w, fuse_wgrad=False)  # unmarked: autograd's gradient, main_grad untouched
    w.grad = None
    embedding(ids, w).backward(dy)
    torch.testing.assert_close(w.grad, ref - 1)
    torch.testing.assert_close(w.main_grad, ref)


def test_the_residual_gemm_is_chosen_in_training_inside_the_fused_linear(monkeypatch):
    """(autograd is off inside an autograd.Function's forward: the fused linear says it is training)"""
    from paratron.kernels import quack_gemm
    calls = []
    monkeypatch.setattr(quack_gemm, "residual_applies", lambda a: True)
    real = quack_gemm.gemm_add
    monkeypatch.setattr(quack_gemm, "gemm_add", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(4, 8, requires_grad=True)
    w.main_grad = torch.zeros(4, 8)
    update_spec(w, fuse_wgrad=True)
    x, res = torch.randn(3, 8, requires_grad=True), torch.randn(3, 4)
    y = ga.linear(x, w, None, res)
    torch.testing.assert_close(y, res + x @ w.detach().t())
    with torch.no_grad():
        ga.linear(x, w, None, res)  # generation: torch's addmm
    assert len(calls) == 1
