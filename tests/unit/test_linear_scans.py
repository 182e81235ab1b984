"""The chunked scans (Mamba-2's SSD, the gated delta rule) equal their sequential recurrences in fp64, forward
and gradients, across chunk boundaries and packed-document resets; the short convolution resets too."""
import pytest
import torch
import torch.nn.functional as F

from paratron.kernels import linear_scan
from paratron.kernels.causal_conv import causal_conv
from paratron.kernels.gated_delta import gated_delta_chunked, gated_delta_sequential
from paratron.kernels.ssd import resets_of, ssd_chunked, ssd_sequential
from paratron.model.recompute import saved_storage_bytes

B, S, H, G = 2, 11, 4, 2
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2],  # a document starts on a chunk boundary (4), mid-chunk
                     [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])


def ssd_inputs(gen):
    d = torch.float64
    return dict(x=torch.randn(B, S, H, 3, generator=gen, dtype=d), dt=F.softplus(torch.randn(B, S, H, generator=gen,
                dtype=d)), A=-torch.rand(H, generator=gen, dtype=d) * 2, B=torch.randn(B, S, G, 5, generator=gen,
                dtype=d), C=torch.randn(B, S, G, 5, generator=gen, dtype=d),
                state=torch.randn(B, H, 3, 5, generator=gen, dtype=d))


def gdn_inputs(gen):
    d = torch.float64
    return dict(q=F.normalize(torch.randn(B, S, H, 4, generator=gen, dtype=d), dim=-1),
                k=F.normalize(torch.randn(B, S, H, 4, generator=gen, dtype=d), dim=-1),
                v=torch.randn(B, S, H, 3, generator=gen, dtype=d),
                g=-F.softplus(torch.randn(B, S, H, generator=gen, dtype=d)),
                beta=torch.rand(B, S, H, generator=gen, dtype=d), state=torch.randn(B, H, 4, 3, generator=gen,
                                                                                   dtype=d))


def run(fn, inputs, **kw):
    inputs = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    y, state = fn(**inputs, **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum() + (state * state).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return y.detach(), state.detach(), grads


CASES = [(ssd_sequential, ssd_chunked, ssd_inputs), (gated_delta_sequential, gated_delta_chunked, gdn_inputs)]


@pytest.mark.parametrize("sequential,chunked,inputs", CASES, ids=["ssd", "gated_delta"])
@pytest.mark.parametrize("docs", [False, True], ids=["one_doc", "reset"])
def test_chunked_equals_sequential(sequential, chunked, inputs, docs):
    x = inputs(torch.Generator().manual_seed(0))
    reset = resets_of(DOCS) if docs else None
    ref = run(sequential, x, reset=reset)
    for q in (4, 5, 16):  # boundaries on and off the document starts; one chunk longer than the sequence
        got = run(chunked, x, reset=reset, chunk_size=q)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)
        for a, b in zip(got[2], ref[2]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sequential,chunked,inputs", CASES, ids=["ssd", "gated_delta"])
def test_carry_and_reset_matter(sequential, chunked, inputs):
    """The equality above would catch a dropped chunk-boundary carry or an ignored reset: each changes the
    outputs by far more than the tolerance on these inputs."""
    x = inputs(torch.Generator().manual_seed(1))
    reset = resets_of(DOCS)
    y = sequential(**x, reset=reset)[0]
    no_reset = chunked(**x, chunk_size=4)[0]
    no_carry = torch.cat([chunked(**{k: (v[:, i:i + 4] if v.dim() > 1 and k != "state" else v)
                                     for k, v in x.items()}, reset=reset[:, i:i + 4], chunk_size=4)[0]
                          for i in range(0, S, 4)], dim=1)
    assert (no_reset - y).abs().max() > 1e-2
    assert (no_carry - y).abs().max() > 1e-2


def test_documents_are_independent():
    """A document's outputs do not depend on the documents packed before it (nor on the initial state)."""
    x = ssd_inputs(torch.Generator().manual_seed(2))
    y = ssd_chunked(**x, reset=resets_of(DOCS), chunk_size=4)[0]
    last = {k: (v[:1, 7:] if k not in ("A", "state") else v) for k, v in x.items() if k != "state"}
    torch.testing.assert_close(y[:1, 7:], ssd_sequential(**last)[0], rtol=1e-10, atol=1e-10)
    q = gdn_inputs(torch.Generator().manual_seed(2))
    o = gated_delta_chunked(**q, reset=resets_of(DOCS), chunk_size=4)[0]
    last = {k: v[1:, 6:] for k, v in q.items() if k != "state"}
    torch.testing.assert_close(o[1:, 6:], gated_delta_sequential(**last)[0], rtol=1e-10, atol=1e-10)


def test_causal_conv_resets_and_state():
    gen = torch.Generator().manual_seed(3)
    x, w, bias = (torch.randn(B, S, 6, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen,
                  dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64))

    def torch_conv(seg):  # nn.Conv1d's causal form over one document
        return F.conv1d(seg.transpose(1, 2), w[:, None], bias, padding=3, groups=6)[..., :seg.size(1)].transpose(1, 2)

    out, state = causal_conv(x, w, bias, resets_of(DOCS))
    for row in range(B):
        for d in DOCS[row].unique():
            idx = (DOCS[row] == d).nonzero().flatten()
            torch.testing.assert_close(out[row:row + 1, idx], torch_conv(x[row:row + 1, idx]))
    # the state carries the last inputs of the last document: continuing token by token equals one pass
    full, _ = causal_conv(x, w, bias)
    part, st = causal_conv(x[:, :7], w, bias)
    for t in range(7, S):
        o, st = causal_conv(x[:, t:t + 1], w, bias, state=st)
        torch.testing.assert_close(o[:, 0], full[:, t])
    late = torch.zeros(B, S, dtype=torch.bool)
    late[:, S - 2] = True  # a document begins 2 positions before the end: the oldest state entry is dropped
    state = causal_conv(x, w, bias, late)[1]
    assert torch.equal(state[:, 0], torch.zeros_like(state[:, 0])) and torch.equal(state[:, 1:], x[:, -2:])


def saved_bytes(fn, inputs) -> tuple[int, int]:
    """(bytes of the distinct storages autograd saves for backward while ``fn`` runs, bytes of ``inputs``)."""
    inputs = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    total, _ = saved_storage_bytes(lambda: fn(**inputs))
    return total, sum(v.numel() * v.element_size() for v in inputs.values())


SCANS = [(linear_scan.ssd, ssd_inputs), (linear_scan.gated_delta, gdn_inputs)]


@pytest.mark.parametrize("scan,inputs", SCANS, ids=["ssd", "gated_delta"])
def test_recompute_gives_the_same_values_and_gradients(scan, inputs):
    """--kernel-linear-scan-recompute on: the chunked torch scans recompute their intermediates in backward;
    outputs, final states and every gradient (fp64, packed-document resets, an initial state) are the ones
    of the scan that keeps them."""
    x = inputs(torch.Generator().manual_seed(4))
    reset = resets_of(DOCS)
    want = run(scan, x, reset=reset, chunk_size=4, recompute=False)
    got = run(scan, x, reset=reset, chunk_size=4, recompute=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scan,inputs", SCANS, ids=["ssd", "gated_delta"])
def test_recompute_keeps_only_the_inputs(scan, inputs):
    """Without recomputation the chunked scan saves its [chunk x chunk] products (several times its inputs);
    with it, autograd saves the inputs only (the checkpoint saves its arguments through the same hooks; its
    own hooks keep recipes for the rest). Fails if the switch is silently ignored."""
    x = inputs(torch.Generator().manual_seed(5))
    kept, size = saved_bytes(lambda **t: scan(**t, reset=resets_of(DOCS), chunk_size=4, recompute=False), x)
    again, _ = saved_bytes(lambda **t: scan(**t, reset=resets_of(DOCS), chunk_size=4, recompute=True), x)
    assert kept > 3 * size, (kept, size)
    assert again <= size + DOCS.numel(), (again, size)  # the inputs and the resets (one byte each)
    with torch.no_grad():  # no graph: no checkpoint either (generation's prefill)
        assert saved_bytes(lambda **t: scan(**t, chunk_size=4, recompute=True), x)[0] == 0
