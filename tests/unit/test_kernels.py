"""The Triton kernels of paratron/kernels/swiglu.py, kernels/decode_attention.py, kernels/paged_attention.py and
kernels/accumulate.py (gradient accumulation) against the torch expressions they replace, run through Triton's CPU
interpreter (the same kernels run on CUDA in tests/gpu)."""
import pytest
import torch

pytest.importorskip("triton")

from tests.interpret import interpret as _interpret  # noqa: E402


CHECK = r"""
import torch
from paratron.kernels.swiglu import swiglu_reference
torch.manual_seed(0)
# odd sizes: a column block that is partly masked, more than one block per row, leading dims
for shape, dtype, tol in (((5, 3, 2 * 1500), torch.float32, 1e-6), ((7, 2 * 64), torch.bfloat16, 1e-2),
                          ((0, 2 * 8), torch.float32, 0.0)):
    h = torch.randn(*shape, dtype=dtype, requires_grad=True)
    g = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
    out = torch.ops.paratron.swiglu(h)
    out.backward(g)
    ref_h = h.detach().double().requires_grad_()
    ref = swiglu_reference(ref_h)
    ref.backward(g.double())
    assert out.shape == ref.shape and out.dtype == dtype and h.grad.dtype == dtype
    for got, want in ((out, ref), (h.grad, ref_h.grad)):
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= tol, (shape, dtype, err)
print("ok")
"""


def test_swiglu_kernel_matches_torch_in_the_interpreter():
    _interpret(CHECK)


DECODE = r"""
import torch
import torch.nn.functional as F
from paratron.kernels.decode_attention import decode_attention_reference
torch.manual_seed(0)
# rows with different padding (one whose first 64-slot block is all padding), slots short of the
# capacity (never read), fp32 and bf16, head dims 16 and 64, 1 and 4 queries per group
for b, g, qpg, d, cap, slot, dtype, tol in ((3, 2, 4, 16, 150, 137, torch.float32, 1e-5),
                                            (2, 1, 1, 64, 64, 5, torch.float32, 1e-5),
                                            (3, 2, 4, 64, 200, 190, torch.bfloat16, 2e-2)):
    q = torch.randn(b, g, qpg, d, dtype=dtype)
    k, v = torch.randn(2, b, g, cap, d, dtype=dtype)
    k[:, :, slot + 1:] = float("nan")  # beyond the current slot: must not be read
    v[:, :, slot + 1:] = float("nan")
    pad = torch.tensor([0, min(70, slot), 3][:b])
    got = torch.ops.paratron.decode_attention(q, k, v, pad, torch.tensor(slot), 0.125)
    want = decode_attention_reference(q, k.nan_to_num(), v.nan_to_num(), pad, torch.tensor(slot), 0.125)
    t = torch.arange(cap)
    mask = ((t[None, :] >= pad[:, None]) & (t[None, :] <= slot))[:, None, None, :]
    sdpa = F.scaled_dot_product_attention(q.double(), k.nan_to_num().double(), v.nan_to_num().double(),
                                          attn_mask=mask, scale=0.125)
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
    for other in (want, sdpa):
        err = ((got.double() - other.double()).norm() / other.double().norm()).item()
        assert err <= tol, (b, g, qpg, d, dtype, err)
print("ok")
"""


PAGED = r"""
from paratron.kernels.paged_attention import paged_attention_reference
torch.manual_seed(0)
# block sizes under (not a power of two) and over the kernel's 64-key tile; tokens of one request at different
# lengths; tables whose unused entries point anywhere (never read); bf16 and fp32
for bs, g, qpg, d, dtype, tol in ((5, 2, 4, 16, torch.bfloat16, 2e-2), (128, 1, 2, 16, torch.float32, 1e-5)):
    blocks = 40
    k_pool, v_pool = torch.randn(2, blocks, bs, g, d).to(dtype)
    tables = torch.randint(1, blocks, (3, 200 // bs + 2))
    lengths = torch.tensor([1, 37, 130, 64])
    rows = torch.tensor([0, 0, 1, 2])
    q = torch.randn(4, g, qpg, d).to(dtype)
    got = torch.ops.paratron.paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.25)
    want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25)
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err <= tol, (bs, g, qpg, d, dtype, err)
    # a sliding window (the last window + 1 cached tokens) and a sink logit per head (gpt-oss)
    sinks = torch.randn(g * qpg)
    for window, sink in ((3, None), (70, None), (None, sinks), (5, sinks)):
        got = torch.ops.paratron.paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.25,
                                                 -1 if window is None else window, sink)
        want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25, window, sink)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, (bs, window, sink is not None, dtype, err)
    plain = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25)
    assert not torch.allclose(plain.float(), want.float(), atol=1e-2)  # the window and sinks change the output
print("ok")
"""


TILED = r"""
from paratron.kernels.paged_attention import paged_attention_reference, tiles_of, tile_tokens
torch.manual_seed(1)
# packed chunks of three requests (a prompt chunk longer than a tile, one after a cached prefix, a decode token),
# tiles of consecutive tokens of one request, causal within a tile; windows and sinks; bf16 and fp32
for bs, g, qpg, d, dtype, tol in ((5, 2, 4, 16, torch.bfloat16, 2e-2), (64, 1, 2, 16, torch.float32, 1e-5)):
    blocks = 60
    k_pool, v_pool = torch.randn(2, blocks, bs, g, d).to(dtype)
    tables = torch.randint(1, blocks, (3, 300 // bs + 2))
    chunks, starts = [37, 20, 1], [0, 90, 140]  # tokens computed this pass, cached before it
    rows = torch.cat([torch.full((n,), r) for r, n in enumerate(chunks)])
    lengths = torch.cat([torch.arange(s + 1, s + n + 1) for s, n in zip(starts, chunks)])
    q = torch.randn(len(rows), g, qpg, d).to(dtype)
    tiles = torch.tensor(tiles_of(chunks, qpg))
    assert tiles[:, 1].sum() == len(rows) and tiles[:, 1].max() == tile_tokens(qpg)
    sinks = torch.randn(g * qpg)
    for window, sink in ((None, None), (3, None), (30, sinks), (None, sinks)):
        got = torch.ops.paratron.paged_prefill(q, k_pool, v_pool, tables, rows, lengths, tiles, 0.25,
                                               -1 if window is None else window, sink)
        want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25, window, sink)
        assert got.shape == q.shape and torch.isfinite(got).all()
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, (bs, qpg, window, sink is not None, dtype, err)
print("ok")
"""


def test_tiled_kernel_launches_cover_every_tile_size_once():
    """Tiles of a few tokens go to a narrow launch, full tiles to one of a tile's rows; together they take every
    count from 1 to a full tile exactly once (llama's grouping: 4 query heads, tiles of 16 tokens -> 1..4, 5..16)."""
    from paratron.kernels.paged_attention import _tile_launches, tile_tokens
    assert _tile_launches(4, tile_tokens(4)) == [(1, 4, 4), (5, 16, 16)]
    for qp in (1, 2, 4, 8, 16, 32, 64, 128):
        per = tile_tokens(qp)
        launches = _tile_launches(qp, per)
        taken = [c for least, most, _ in launches for c in range(least, most + 1)]
        assert taken == list(range(1, per + 1)), qp
        assert all(tokens >= most for _, most, tokens in launches)  # every taken tile fits the launch's rows
    assert len(_tile_launches(64, tile_tokens(64))) == 1  # a tile of one token: nothing narrower


def test_tiled_paged_attention_kernel_matches_torch_in_the_interpreter():
    """The paged kernel's tiled form for prompt chunks (kernels/paged_attention.py, ``tiles``)."""
    _interpret("import torch\n" + TILED)


def test_decode_attention_kernels_match_torch_in_the_interpreter():
    """The fixed-batch decode kernel and the paged engine's (kernels/paged_attention.py), in one interpreter."""
    _interpret(DECODE.replace('print("ok")', "") + PAGED)


ACCUMULATE = r"""
import torch
from paratron.kernels import accumulate as kernels
torch.manual_seed(0)
for n, dtype in ((10_000, torch.bfloat16), (4096, torch.float16), (5, torch.bfloat16)):
    g = torch.randn(n).to(dtype)
    acc = torch.randn(n)
    want_add, want_write = acc + g.float(), g.float()
    kernels._accumulate[((n + kernels.ACC_BLOCK - 1) // kernels.ACC_BLOCK,)](acc, g, n, WRITE=False,
                                                                           BLOCK=kernels.ACC_BLOCK)
    assert torch.equal(acc, want_add), (n, dtype)
    kernels._accumulate[((n + kernels.ACC_BLOCK - 1) // kernels.ACC_BLOCK,)](acc, g, n, WRITE=True,
                                                                           BLOCK=kernels.ACC_BLOCK)
    assert torch.equal(acc, want_write), (n, dtype)
# fc1's interleaved weight gradient into [gate; up] halves: a row longer than one block, odd row count
for half, cols in ((3, 5000), (1, 7)):
    g = torch.randn(2 * half, cols).bfloat16()
    acc = torch.randn(2 * half, cols)
    want = acc + torch.cat([g[0::2], g[1::2]]).float()
    kernels._accumulate_deinterleaved[(2 * half, (cols + kernels.ACC_BLOCK - 1) // kernels.ACC_BLOCK)](
        acc, g, half, cols, BLOCK=kernels.ACC_BLOCK)
    assert torch.equal(acc, want), (half, cols)
# an embedding table's gradient: rows added at their tokens' ids (a repeated id, a row longer than a block)
for t, h in ((6, 1500), (3, 8)):
    ids = torch.tensor([2, 0, 2, 5, 2, 1][:t])
    dy = torch.randn(t, h).bfloat16()
    acc = torch.randn(6, h)
    want = acc.clone().index_add_(0, ids, dy.float())
    kernels._embedding_accumulate[(t, (h + kernels.EMB_BLOCK - 1) // kernels.EMB_BLOCK)](
        acc, ids, dy, h, BLOCK=kernels.EMB_BLOCK)
    torch.testing.assert_close(acc, want, rtol=0, atol=1e-6)
print("ok")
"""


def test_gradient_accumulation_kernel_adds_and_writes_exactly_in_the_interpreter():
    _interpret(ACCUMULATE)


def test_accumulate_falls_back_to_torch_on_cpu():
    from paratron.kernels import accumulate as kernels
    acc, g = torch.ones(7), torch.full((7,), 0.5, dtype=torch.bfloat16)
    kernels.accumulate_(acc, g, write=False)
    assert torch.equal(acc, torch.full((7,), 1.5))
    kernels.accumulate_(acc, g, write=True)
    assert torch.equal(acc, torch.full((7,), 0.5))
