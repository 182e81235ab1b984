import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.model.gpt import GPTModel
from paratron.model.layers import ForwardContext, apply_rotary, rope_inv_freq
from paratron.parallel.dims import initialize_model_parallel
from paratron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, \
    vocab_parallel_cross_entropy


def tiny(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True)


def test_parallel_layers_are_plain_at_size_one():
    x = torch.randn(3, 5, 8)
    col, row = ColumnParallelLinear(8, 12), RowParallelLinear(12, 8)
    ref = nn.Linear(8, 12)
    ref.load_state_dict(col.state_dict())
    assert torch.equal(col(x), ref(x))
    y = torch.randn(3, 5, 12)
    ref2 = nn.Linear(12, 8)
    ref2.load_state_dict(row.state_dict())
    assert torch.equal(row(y), ref2(y))
    emb = VocabParallelEmbedding(50, 8)
    ids = torch.randint(0, 50, (2, 7))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    logits, t = torch.randn(4, 6, 50), torch.randint(0, 50, (4, 6))
    assert torch.allclose(vocab_parallel_cross_entropy(logits, t),
                          F.cross_entropy(logits.reshape(-1, 50), t.reshape(-1), reduction="none").view(4, 6))


def test_dims_single_rank_and_rank_layout():
    d = initialize_model_parallel()
    assert (d.tp, d.pp, d.dp, d.world_size) == (1, 1, 1, 1) and d.tp_group is None
    # Megatron's order tp-cp-ep-dp-pp: rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP
    d = initialize_model_parallel(2, 2, context_parallel_size=2, world_size=16, rank=13)
    assert (d.tp_rank, d.cp_rank, d.dp_rank, d.pp_rank, d.dp) == (1, 0, 1, 1, 2)
    assert d.group_ranks["tp"] == [12, 13] and d.group_ranks["pp"] == [5, 13]
    assert d.group_ranks["dp"] == [9, 13] and d.group_ranks["dp_cp"] == [9, 11, 13, 15]
    assert d.group_ranks["embedding"] == [5, 13]


def test_impossible_layout_is_a_clear_error():
    from paratron.config import ConfigError
    with pytest.raises(ConfigError, match="not divisible by TP 2 x PP 2"):
        initialize_model_parallel(2, 2, world_size=6, rank=0)


@pytest.mark.parametrize("kw", [{}, LLAMA, dict(LLAMA, qk_layernorm=True), dict(num_query_groups=1,
                                                                                 group_query_attention=True)])
def test_model_shapes_and_backward(kw):
    torch.manual_seed(0)
    m = GPTModel(tiny(**kw).resolved(), 128)
    ids = torch.randint(0, 128, (2, 16))
    logits = m(ids)
    assert logits.shape == (2, 16, 128)
    loss = m(ids, labels=ids)
    assert loss.shape == (2, 16)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 128), ids.reshape(-1), reduction="none").view(2, 16),
                          atol=1e-5)
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_causality():
    torch.manual_seed(0)
    m = GPTModel(tiny(**LLAMA).resolved(), 128).eval()
    a = torch.randint(0, 128, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 128
    assert torch.allclose(m(a)[0, :10], m(b)[0, :10], atol=1e-6)
    assert not torch.allclose(m(a)[0, 10:], m(b)[0, 10:])


def test_gqa_equals_repeated_kv_heads():
    """A GQA model equals the MHA model whose k/v heads are copies of the group's."""
    torch.manual_seed(0)
    g = GPTModel(tiny(**LLAMA).resolved(), 128).eval()
    mha_cfg = tiny(**dict(LLAMA, group_query_attention=False, num_query_groups=None))
    m = GPTModel(mha_cfg.resolved(), 128).eval()
    sd = g.state_dict()
    d, heads, groups = 16, 4, 2
    for i in range(2):
        w = sd[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(groups, heads // groups + 2, d, 64)
        q, k, v = w[:, :-2], w[:, -2:-1], w[:, -1:]
        # MHA layout: one group per head = [q_h, k_h, v_h]
        rows = []
        for h in range(heads):
            grp = h // (heads // groups)
            rows += [q[grp, h % (heads // groups)], k[grp, 0], v[grp, 0]]
        sd[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat(rows)
    m.load_state_dict(sd)
    ids = torch.randint(0, 128, (2, 16))
    assert torch.allclose(g(ids), m(ids), atol=1e-5)


def test_rotary_is_a_rotation_and_relative():
    inv = rope_inv_freq(8, 10000.0)
    pos = torch.arange(12).float()
    f = torch.outer(pos, inv)
    cos, sin = torch.cat([f, f], -1).cos()[:, None, None], torch.cat([f, f], -1).sin()[:, None, None]
    q = torch.randn(12, 1, 1, 8)
    out = apply_rotary(q, cos, sin)
    assert torch.allclose(out.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # dot products depend only on the distance: <R_m q, R_n k> == <R_{m+1} q, R_{n+1} k>
    k = torch.randn(1, 1, 1, 8)
    qr = apply_rotary(q[:1].expand(12, 1, 1, 8), cos, sin)
    kr = apply_rotary(k.expand(12, 1, 1, 8), cos, sin)
    assert torch.allclose((qr[3] * kr[1]).sum(), (qr[7] * kr[5]).sum(), atol=1e-5)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain, scaled = rope_inv_freq(64, 500000.0), rope_inv_freq(64, 500000.0, scaling=True, factor=8.0)
    assert torch.allclose(plain[:4], scaled[:4])  # high frequencies kept
    assert torch.allclose(plain[-1] / 8, scaled[-1])  # lowest divided by the factor


@pytest.mark.parametrize("gran,method", [("full", "uniform"), ("full", "block"), ("selective", None)])
def test_recompute_gives_the_same_gradients(gran, method):
    torch.manual_seed(0)
    ref = GPTModel(tiny(**LLAMA).resolved(), 128)
    torch.manual_seed(0)
    rc = GPTModel(tiny(**LLAMA).resolved(), 128, recompute_granularity=gran, recompute_method=method,
                  recompute_num_layers=1)
    ids = torch.randint(0, 128, (2, 16))
    ref(ids, labels=ids).mean().backward()
    rc(ids, labels=ids).mean().backward()
    for (n, a), b in zip(ref.named_parameters(), rc.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def test_init_follows_megatron():
    torch.manual_seed(0)
    cfg = tiny(num_layers=8, hidden_size=256, num_attention_heads=4, init_method_std=0.02)
    m = GPTModel(cfg.resolved(), 1024)
    proj = m.decoder.layers[0].self_attention.linear_proj.weight
    qkv = m.decoder.layers[0].self_attention.linear_qkv.weight
    assert abs(qkv.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / 4.0) < 0.0005  # std / sqrt(2 * layers)
    assert m.decoder.layers[0].self_attention.linear_qkv.bias.abs().sum() == 0


def test_embedding_init_std_is_its_own():
    """--embedding-init-method-std (Megatron's): word and position embeddings (and a tied output layer's
    copy) drawn with it; the other weights keep --init-method-std; unset, the embeddings do too."""
    torch.manual_seed(0)
    m = GPTModel(tiny(hidden_size=256, init_method_std=0.02, embedding_init_method_std=1.0,
                      untie_embeddings_and_output_weights=True).resolved(), 1024)
    assert abs(m.embedding.word_embeddings.weight.std().item() - 1.0) < 0.02
    assert abs(m.embedding.position_embeddings.weight.std().item() - 1.0) < 0.05
    assert abs(m.output_layer.weight.std().item() - 0.02) < 0.002
    assert abs(m.decoder.layers[0].self_attention.linear_qkv.weight.std().item() - 0.02) < 0.002
    plain = GPTModel(tiny(hidden_size=256, init_method_std=0.02).resolved(), 1024)
    assert abs(plain.embedding.word_embeddings.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("kw", [{}, LLAMA])
def test_fused_output_loss_equals_logits_path(kw):
    torch.manual_seed(0)
    a = GPTModel(tiny(**kw).resolved(), 128)
    b = GPTModel(tiny(**kw).resolved(), 128)
    b.load_state_dict(a.state_dict())
    b.fused_output_loss = False
    ids = torch.randint(0, 128, (3, 16))
    la, lb = a(ids, labels=ids), b(ids, labels=ids)
    assert torch.allclose(la, lb, atol=1e-5)
    w = torch.rand(3, 16)
    (la * w).sum().backward()
    (lb * w).sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize("kw", [{}, LLAMA], ids=["gpt", "llama"])
def test_residual_inside_fc2_equals_the_separate_add(kw):
    """Without dropout fc2 and the attention's linear_proj add the residual as their matmuls' C operand
    (bias-free layers); with --no-bias-dropout-fusion it is a separate add. Same loss and gradients
    either way."""
    torch.manual_seed(0)
    a = GPTModel(tiny(**kw).resolved(), 128)
    b = GPTModel(tiny(**kw, no_bias_dropout_fusion=True).resolved(), 128)
    b.load_state_dict(a.state_dict())
    assert a.decoder.layers[0].fuse_residual and not b.decoder.layers[0].fuse_residual
    seen = []  # the fused path really runs addmm on the bias-free (Llama) layers
    real_addmm = torch.addmm
    torch.addmm = lambda *args, **kwargs: seen.append(1) or real_addmm(*args, **kwargs)
    try:
        ids = torch.randint(0, 128, (3, 16))
        la = a(ids, labels=ids)
    finally:
        torch.addmm = real_addmm
    assert len(seen) == (4 if kw else 0)  # two layers, two output projections each
    lb = b(ids, labels=ids)
    assert torch.allclose(la, lb, atol=1e-5)
    la.sum().backward()
    lb.sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize("keep_bytes", [2**33, 0], ids=["kept-gradient", "recomputed-logits"])
def test_linear_cross_entropy_chunks_and_bf16(keep_bytes):
    from paratron.parallel.tensor import linear_cross_entropy
    torch.manual_seed(0)
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    g = torch.rand(37, dtype=torch.float64)
    ref = F.cross_entropy(x @ w.t(), t, reduction="none")
    (ref * g).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    got = linear_cross_entropy(x, w, t, chunk_bytes=4 * 50 * 5, keep_bytes=keep_bytes)  # chunks of 5 tokens
    (got * g).sum().backward()
    assert torch.allclose(got.double(), ref) and torch.allclose(x.grad, gx) and torch.allclose(w.grad, gw)
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    lb = linear_cross_entropy(xb, wb, t, keep_bytes=keep_bytes)
    assert lb.dtype == torch.float32 and (lb.double() - ref).abs().max() < 0.5
    (lb * g).sum().backward()
    for got_grad, want in ((xb.grad, gx), (wb.grad, gw)):
        assert got_grad.dtype == torch.bfloat16
        assert (got_grad.double() - want).norm() / want.norm() < 0.05


def test_checkpoint_replays_the_tp_stream_and_leaves_it_as_the_forward_did():
    """The recomputation draws the forward's masks from the TP-region stream, and afterwards the stream
    is where the forward left it, although checkpoint stops recomputing after the dropout (the last op
    that saves a tensor for backward: the draw of torch.rand_like is never recomputed)."""
    from paratron.parallel.random import RNGTracker, checkpoint

    def fn(x, w, rng):
        with rng.fork():
            h = F.dropout(x @ w, 0.5, True)
            return h + torch.rand_like(h)

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    plain = fn(x, w, RNGTracker(1, 0))
    plain.sum().backward()
    want = w.grad.clone()
    w.grad, rng = None, RNGTracker(1, 0)
    out = checkpoint(fn, x, w, rng, rng=rng)
    after_forward = rng.state.clone()
    out.sum().backward()
    assert torch.equal(out, plain) and torch.equal(w.grad, want)
    assert torch.equal(rng.state, after_forward)


@pytest.mark.parametrize("gated", [False, True])
def test_attention_backward_writes_the_qkv_gradient_once(gated):
    """The projection's output is split into queries (and the output gate), keys and values: the backward then writes
    one qkv-sized gradient (a cat), where a slice and two selects would each write a whole qkv-sized gradient (zeros
    and the slice's values) and add them. Counted: the backward's outputs of qkv's size."""
    from torch.utils._python_dispatch import TorchDispatchMode
    model = GPTModel(tiny(num_query_groups=2, group_query_attention=True, attention_output_gate=gated).resolved(), 64)
    attn = model.decoder.layers[0].self_attention
    rows = attn.linear_qkv.weight.shape[0]
    s, b = 11, 3  # (no other tensor of the step has s x b x rows elements)
    x = torch.randn(s, b, model.config.hidden_size, requires_grad=True)
    rope = model.rotary(s, None) if model.rotary is not None else None
    out = attn(x, ForwardContext(rope=rope))

    class Sized(TorchDispatchMode):
        found = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            outs = res if isinstance(res, (tuple, list)) else [res]
            self.found += sum(isinstance(t, torch.Tensor) and t.numel() == s * b * rows and not func.is_view
                              for t in outs)
            return res
    with Sized() as counted:
        out.square().sum().backward()
    assert counted.found == 1, counted.found
