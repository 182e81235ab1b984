"""Packed documents with a state each (kernels/varlen.py, kernels/causal_conv.py ``causal_conv_varlen``, the
``cu_seqlens`` path of kernels/linear_scan.py): Mamba-2's scan, the gated delta rule and the short convolution
over one packed row equal each document run alone from its own state (fp32), outputs and final states, for
documents of one token, shorter than the convolution, and of lengths that are not multiples of the chunk."""
import pytest
import torch
import torch.nn.functional as F

from paratron.kernels import linear_scan
from paratron.kernels.causal_conv import causal_conv
from paratron.kernels.gated_delta import gated_delta_sequential
from paratron.kernels.ssd import ssd_sequential
from paratron.kernels.varlen import chunk_aligned, gated_delta_varlen, lengths_of, ssd_varlen

LENGTHS = [1, 6, 4, 2, 9, 1, 3]  # chunk 4: one token, a whole chunk, a chunk and a bit, two and a bit
H, G = 4, 2


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def ssd_inputs(gen, total, docs):
    return dict(x=torch.randn(1, total, H, 3, generator=gen), dt=F.softplus(torch.randn(1, total, H, generator=gen)),
                A=-torch.rand(H, generator=gen) * 2, B=torch.randn(1, total, G, 5, generator=gen),
                C=torch.randn(1, total, G, 5, generator=gen)), torch.randn(docs, H, 3, 5, generator=gen)


def gdn_inputs(gen, total, docs):
    return dict(q=F.normalize(torch.randn(1, total, H, 4, generator=gen), dim=-1),
                k=F.normalize(torch.randn(1, total, H, 4, generator=gen), dim=-1),
                v=torch.randn(1, total, H, 3, generator=gen), g=-F.softplus(torch.randn(1, total, H, generator=gen)),
                beta=torch.rand(1, total, H, generator=gen)), torch.randn(docs, H, 4, 3, generator=gen)


def doc(inputs: dict, a: int, b: int) -> dict:
    return {k: t if k == "A" else t[:, a:b] for k, t in inputs.items()}


CASES = [(ssd_varlen, ssd_sequential, ssd_inputs, linear_scan.ssd),
         (gated_delta_varlen, gated_delta_sequential, gdn_inputs, linear_scan.gated_delta)]


@pytest.mark.parametrize("varlen,sequential,inputs,dispatch", CASES, ids=["ssd", "gated_delta"])
@pytest.mark.parametrize("with_state", [True, False], ids=["states", "zeros"])
def test_packed_documents_equal_each_alone(varlen, sequential, inputs, dispatch, with_state):
    cu = offsets(LENGTHS)
    kw, states = inputs(torch.Generator().manual_seed(0), sum(LENGTHS), len(LENGTHS))
    states = states if with_state else None
    y, final = varlen(**kw, cu_seqlens=cu, state=states, chunk_size=4)
    assert y.shape[:2] == (1, sum(LENGTHS)) and final.shape[0] == len(LENGTHS)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want_y, want_state = sequential(**doc(kw, a, b), state=None if states is None else states[i:i + 1])
        torch.testing.assert_close(y[:, a:b], want_y, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(final[i:i + 1], want_state, atol=2e-5, rtol=1e-5)
    # through the kernel switch's entry point (the torch path): the same numbers
    got_y, got_final = dispatch(**kw, state=states, chunk_size=4, cu_seqlens=cu)
    assert torch.equal(got_y, y) and torch.equal(got_final, final)


@pytest.mark.parametrize("varlen,sequential,inputs,dispatch", CASES, ids=["ssd", "gated_delta"])
def test_a_document_does_not_see_its_neighbours(varlen, sequential, inputs, dispatch):
    """Changing one document's tokens and state changes its own outputs and final state, no other's."""
    cu = offsets(LENGTHS)
    kw, states = inputs(torch.Generator().manual_seed(1), sum(LENGTHS), len(LENGTHS))
    y, final = varlen(**kw, cu_seqlens=cu, state=states, chunk_size=4)
    a, b = cu[4].item(), cu[5].item()
    kw2 = {k: t.clone() for k, t in kw.items()}
    for k, t in kw2.items():
        if k != "A":
            t[:, a:b] = t[:, a:b].flip(1)
    states2 = states.clone()
    states2[4] = states2[4] * 2
    y2, final2 = varlen(**kw2, cu_seqlens=cu, state=states2, chunk_size=4)
    outside = torch.ones(y.size(1), dtype=torch.bool)
    outside[a:b] = False
    assert torch.equal(y[:, outside], y2[:, outside]) and not torch.allclose(y[:, a:b], y2[:, a:b])
    keep = [i for i in range(len(LENGTHS)) if i != 4]
    assert torch.equal(final[keep], final2[keep]) and not torch.allclose(final[4], final2[4])


def test_causal_conv_packed_documents_equal_each_alone():
    """Documents shorter than the convolution (their new state keeps part of the old one), of one token, longer."""
    gen = torch.Generator().manual_seed(2)
    lengths, c, width = [1, 2, 5, 3, 8, 1], 6, 4
    cu, total = offsets(lengths), sum(lengths)
    x, w = torch.randn(1, total, c, generator=gen), torch.randn(c, 1, width, generator=gen)
    bias = torch.randn(c, generator=gen)
    states = torch.randn(len(lengths), width - 1, c, generator=gen)
    for state in (states, None):
        out, new = causal_conv(x, w, bias, state=state, cu_seqlens=cu)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            want, want_state = causal_conv(x[:, a:b], w, bias, state=None if state is None else state[i:i + 1])
            torch.testing.assert_close(out[:, a:b], want, atol=1e-6, rtol=1e-6)
            assert torch.equal(new[i:i + 1], want_state)
    _, new = causal_conv(x, w, bias, state=states, cu_seqlens=cu)
    assert torch.equal(new[1], torch.cat([states[1, -1:], x[0, 1:3]]))  # 2 tokens: the old state's last input kept


def test_chunk_aligned_layout_and_refusals():
    index, starts, length = chunk_aligned([1, 6, 4], 4)
    assert index.tolist() == [0, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15] and starts == [0, 1, 3] and length == 16
    assert lengths_of(offsets([3, 1])) == [3, 1]
    with pytest.raises(ValueError, match="every document a token"):
        lengths_of(torch.tensor([0, 2, 2]))
