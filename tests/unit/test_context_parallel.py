"""Context parallelism on one process: the load-balanced split, the ring's block plan (every causal
pair exactly once), the block kernel and its log-sum-exp merge against plain attention, packed
documents through the model at CP 1, the hybrid mixers' parameter shares, and the config errors (one line, before
step 1)."""
import pytest
import torch
import torch.nn.functional as F

from paratron.config import ConfigError
from paratron.model.gpt import GPTModel
from paratron.parallel.context import document_causal_mask, merge_sequence, natural_order, share_rows, split_sequence
from paratron.parallel.layout import BatchLayout
from paratron.parallel.ring import _merge, block_plan, chunk_positions, math_backward, math_forward
from tests.parallel.common import tiny_config


def test_split_is_load_balanced_and_merge_inverts_it():
    t = torch.arange(16).view(1, 16)
    assert split_sequence(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]  # chunks 0 and 3
    assert split_sequence(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 1 and 2
    assert split_sequence(t, 4, 1).tolist() == [[2, 3, 12, 13]]  # chunks 1 and 6 of 8
    for cp in (2, 4):
        parts = [split_sequence(t, cp, r) for r in range(cp)]
        assert torch.equal(merge_sequence(parts), t)
        assert torch.equal(torch.cat([chunk_positions(r, cp, 16 // (2 * cp)) for r in range(cp)]), torch.cat(parts, 1)[0])
        order = torch.cat(parts, 1).view(2 * cp, -1)[natural_order(cp)]
        assert torch.equal(order.reshape(1, 16), t)
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        split_sequence(torch.zeros(1, 12), 4, 0)
    layout = BatchLayout(2, 16, 8, cp=2, cp_rank=1)
    assert layout.activation_shape() == (8, 2, 8)
    got = layout.prepare({"tokens": t.expand(2, 16), "labels": t.expand(2, 16), "loss_mask": torch.ones(2, 16),
                          "document_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert got["tokens"][0].tolist() == list(range(4, 12)) and got["position_ids"][0].tolist() == list(range(4, 12))
    assert got["document_ids"].shape == (2, 16)  # whole: the ring slices what each block needs


def test_share_rows_slices_each_block_and_its_gradient_lands_there():
    """A hybrid mixer's CP share of a [x | B | C] parameter (blocks 4, 2, 2 rows): rank 1 of 2 takes rows 2-3, 5
    and 7; the gradient reaches exactly those rows of the parameter."""
    w = torch.arange(8.0, requires_grad=True)
    got = share_rows(w, (4, 2, 2), 2, 1)
    assert got.tolist() == [2.0, 3.0, 5.0, 7.0] and share_rows(w, (8,), 4, 3).tolist() == [6.0, 7.0]
    got.sum().backward()
    assert w.grad.tolist() == [0, 0, 1, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_covers_every_causal_pair_exactly_once(cp):
    c, s = 2, 4 * cp
    count = torch.zeros(s, s, dtype=torch.long)
    for rank in range(cp):
        q_pos = chunk_positions(rank, cp, c)
        for src in range(cp):
            blk = block_plan(rank, src, c)
            qs, ks = q_pos[blk.rows], chunk_positions(src, cp, c)[blk.cols]
            allowed = torch.ones(len(qs), len(ks), dtype=torch.long)
            if blk.causal:
                allowed = allowed.tril()
            count[qs[:, None], ks[None, :]] += allowed
    assert torch.equal(count, torch.ones(s, s, dtype=torch.long).tril())


def qkv(b=2, h=4, g=2, s=12, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, g, g, h)]


def test_block_kernel_and_lse_merge_equal_plain_attention():
    q, k, v, dout = qkv()
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    mask = document_causal_mask(docs)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out, lse, _ = math_forward(q, k, v, True, docs[:, :, None] == docs[:, None, :], 8 ** -0.5)
    assert torch.allclose(out.double(), want, atol=1e-6)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) / 8 ** 0.5
    assert torch.allclose(lse.double(), scores.masked_fill(~mask, float("-inf")).logsumexp(-1), atol=1e-5)
    # two key halves merged by their LSE give the whole (non-causal) attention; a plain average would not
    full, full_lse, _ = math_forward(q, k, v, False, None, 8 ** -0.5)
    o1, l1, _ = math_forward(q, k[:, :, :5], v[:, :, :5], False, None, 8 ** -0.5)
    o2, l2, _ = math_forward(q, k[:, :, 5:], v[:, :, 5:], False, None, 8 ** -0.5)
    _merge(o1, l1, o2, l2, first=False)
    assert torch.allclose(o1, full, atol=1e-6) and torch.allclose(l1, full_lse, atol=1e-6)
    # the backward of each half from the final output and LSE sums to the whole's
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, enable_gqa=True).backward(dout)
    parts = [math_backward(dout, q, k[:, :, sl], v[:, :, sl], full, full_lse, False, None, 8 ** -0.5)
             for sl in (slice(0, 5), slice(5, None))]
    assert torch.allclose(parts[0][0] + parts[1][0], qr.grad.float(), atol=1e-5)
    assert torch.allclose(torch.cat([parts[0][1], parts[1][1]], 2), kr.grad.float(), atol=1e-5)
    assert torch.allclose(torch.cat([parts[0][2], parts[1][2]], 2), vr.grad.float(), atol=1e-5)


def test_packed_documents_do_not_see_each_other_at_cp1():
    cfg = tiny_config("llama")
    model = GPTModel(cfg.model, cfg.padded_vocab_size, seed=3).eval()
    tokens = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 12 + [1] * 20])
    pos = torch.cat([torch.arange(12), torch.arange(20)])[None]
    other = tokens.clone()
    other[0, :12] = (other[0, :12] + 1) % 500  # another first document
    with torch.no_grad():
        a = model(tokens, pos, document_ids=docs)
        b = model(other, pos, document_ids=docs)
        alone = model(tokens[:, 12:], pos[:, 12:])
        causal = model(tokens, pos)
    assert torch.allclose(a[:, 12:], b[:, 12:], atol=1e-5) and torch.allclose(a[:, 12:], alone, atol=1e-5)
    assert not torch.allclose(causal[:, 12:], alone, atol=1e-3)  # without the ids the documents would mix


@pytest.mark.parametrize("settings,world,needle", [
    (dict(context_parallel_size=4, seq_length=36), 4, "--seq-length 36 is not divisible by 2 x --context-parallel-size 4"),
    (dict(context_parallel_size=2, tensor_model_parallel_size=2), 6, "world size 6 is not divisible by TP 2 x PP 1 x CP 2"),
    (dict(context_parallel_size=2, pipeline_model_parallel_size=2), 2, "world size 2 is not divisible by TP 1 x PP 2 x CP 2"),
    (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=2, num_query_groups=2), 4,
     "--cp-comm-type a2a needs the attention heads per tensor-parallel rank (2) divisible by --context-parallel-size 4"),
    (dict(context_parallel_size=2, cp_comm_type="a2a+p2p"), 2,
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (dict(hierarchical_context_parallel_sizes=[2, 2]), 1, "--hierarchical-context-parallel-sizes has no effect"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3]), 4,
     "--hierarchical-context-parallel-sizes 2 3: give two sizes"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1],
          num_attention_heads=2, num_query_groups=2), 4, "divisible by the all-to-all size 4"),
    (dict(context_parallel_size=2, attention_dropout=0.1), 2, "--attention-dropout 0.1 with --context-parallel-size 2"),
])
def test_bad_context_parallel_settings_are_one_line_errors(settings, world, needle):
    with pytest.raises(ConfigError) as e:
        tiny_config("gpt", world_size=world, **settings)
    assert needle in str(e.value) and "\n" not in str(e.value)
