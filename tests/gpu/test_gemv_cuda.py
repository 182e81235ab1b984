"""The decode GEMV kernel (paratron/kernels/gemv.py) on the GPU: against F.linear at llama-1b's decode shapes
(1..8 rows, split K and not, fc1's fused SwiGLU, the residual), replayed from a CUDA graph, and a tiny model's
decode (compiled step, CUDA graph, teacher-forced) with --kernel-decode-gemv triton against torch: the same logits
within rounding (batch 1: the layers as kernels/gemv_row.py around the fused attention); the row kernel against its
reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.kernels import gemv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (2048, 8192), (128256, 2048), (1000, 1000)])
def test_kernel_matches_f_linear(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    assert gemv.applies(x, w)
    assert _rel(gemv.linear(x, w), gemv.linear_reference(x, w)) < 1e-2
    assert _rel(gemv.linear(x, w, residual=r), gemv.linear_reference(x, w, residual=r)) < 1e-2


@pytest.mark.parametrize("m", [1, 8])
def test_fused_swiglu_matches_torch(m):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * 8192, 2048, device="cuda", generator=g) * 2048 ** -0.5).bfloat16()
    assert _rel(gemv.swiglu(x, w), gemv.swiglu_reference(x, w)) < 1e-2


def test_kernel_replays_from_a_cuda_graph():
    x = torch.randn(1, 8192, device="cuda").bfloat16()
    w = (torch.randn(2048, 8192, device="cuda") * 0.01).bfloat16()  # split K
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.linear(x, w)  # tune and compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert _rel(out, gemv.linear_reference(x, w)) < 1e-2


def _tiny(kernel: str):
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--config", "tiny", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
                      "rope", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--init-method-std", "0.3", "--mock-data"])
    torch.manual_seed(0)
    kernels = dataclasses.replace(cfg.kernels, kernel_decode_gemv=kernel)
    model = GPTModel(cfg.model, cfg.padded_vocab_size, kernels=kernels, device="cuda", dtype=torch.bfloat16)
    return model.eval(), cfg.data.vocab_size


@torch.no_grad()
def _teacher_forced(engine, prompts, steps: int, tokens=None):
    """Each decode step's logits [b, vocab] after prefilling ``prompts``, feeding ``tokens`` [steps, b] (default: the
    engine's own greedy choices); the tokens fed."""
    from paratron.inference.engine import Request, _Run
    from paratron.inference.sampling import SamplingParams
    run = _Run(engine, [Request(p, SamplingParams(steps + 1)) for p in prompts])
    run.prefill()
    logits, fed = [], []
    for step in range(steps):
        tok = run.last.argmax(-1) if tokens is None else tokens[step]
        fed.append(tok)
        run.last = engine._step(tok[:, None], run.length + step)
        logits.append(run.last.float().clone())
    return logits, fed


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_with_the_kernel_gives_the_torch_paths_logits(batch):
    """Teacher-forced (both engines fed the torch engine's greedy tokens), compiled steps replayed as CUDA graphs: each
    step's logits agree within rounding, and the greedy token is the same wherever torch's top two logits are
    further apart than twice the two paths' largest difference (batch 1: the layers as kernels/gemv_row.py around the
    fused attention; 4: the GEMV kernel per linear layer)."""
    from paratron.inference.engine import Engine
    prompts = torch.randint(0, 100, (batch, 7), generator=torch.Generator().manual_seed(1)).tolist()
    model, vocab = _tiny("torch")
    want, fed = _teacher_forced(Engine(model, vocab, eod=None, compile=True), prompts, 24)
    model, vocab = _tiny("triton")
    engine = Engine(model, vocab, eod=None, compile=True)
    assert engine.gemv and all(layer.decode_rows for layer in model.decoder.layers)
    got, _ = _teacher_forced(engine, prompts, 24, fed)
    # The kernels sum in their own order, and the cache each path fills carries its rounding into later steps; the
    # tiny model's large weights (std 0.3) amplify that to a few percent. A wrong norm, residual or SwiGLU is off by
    # order one from the first step.
    for a, b in zip(got, want):
        assert _rel(a, b) < 5e-2
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (a - b).abs().amax(dim=-1)
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("n,k,norm,res,gated", [(3072, 2048, True, False, False), (2048, 2048, False, True, False),
                                                (8192, 2048, True, False, True), (2048, 8192, False, True, False),
                                                (1000, 1000, True, True, False)])
def test_row_kernel_matches_its_reference(n, k, norm, res, gated, pdl):
    """kernels/gemv_row.py at llama-1b's layer shapes (qkv with its norm, the output projection and fc2 with the
    residual, fc1 with its norm and SwiGLU), launched plain and for programmatic dependent launch."""
    from paratron.kernels import gemv_row
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n * (2 if gated else 1), k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16() if norm else None
    r = torch.randn(1, n, device="cuda", generator=g).bfloat16() if res else None
    assert gemv_row.applies(x, w)
    got = gemv_row.linear(x, w, nw, r, gated, 1e-5, pdl)
    assert _rel(got, gemv_row.row_reference(x, w, nw, r, gated, 1e-5)) < 1e-2
    if norm and not gated:  # qkv with a Qwen2-style bias
        b = torch.randn(n, device="cuda", generator=g).bfloat16()
        got = gemv_row.linear(x, w, nw, r, gated, 1e-5, pdl, bias=b)
        assert _rel(got, gemv_row.row_reference(x, w, nw, r, gated, 1e-5, b)) < 1e-2


def test_row_kernel_replays_from_a_cuda_graph():
    from paratron.kernels import gemv_row
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    w = (torch.randn(2 * 8192, 2048, device="cuda") * 0.02).bfloat16()
    nw = torch.rand(2048, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_row.linear(x, w, nw, gated=True)  # tune and compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_row.linear(x, w, nw, gated=True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert _rel(out, gemv_row.row_reference(x, w, nw, gated=True)) < 1e-2
