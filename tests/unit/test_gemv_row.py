"""The one-row decode GEMV (paratron/kernels/gemv_row.py): its torch reference against the model's own modules, the
custom op's CPU kernel, the Triton kernel through Triton's CPU interpreter (every config of its tuning list, the
norm, SwiGLU, the residual, sizes off every block), and a batch-1 decode step taking the layer as four of these
around the fused attention (TransformerLayer.decode_row): the same tokens, and only layers it can take."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from paratron.kernels import gemv, gemv_row
from paratron.kernels.swiglu import swiglu_reference
from paratron.model.norms import Norm


def test_reference_is_the_models_norm_linear_swiglu_and_residual():
    torch.manual_seed(0)
    x, w, w2, r = (torch.randn(1, 1, 64).bfloat16(), torch.randn(48, 64).bfloat16(), torch.randn(64, 24).bfloat16(),
                   torch.randn(1, 1, 48).bfloat16())
    norm = Norm("RMSNorm", 64, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    h = norm(x)
    assert torch.equal(gemv_row.row_reference(x, w, norm.weight, eps=1e-5), F.linear(h, w))
    assert torch.equal(gemv_row.row_reference(x, w, norm.weight, gated=True, eps=1e-5),
                       swiglu_reference(F.linear(h, w)))
    assert torch.equal(gemv_row.row_reference(x[..., :24], w2, residual=x), x + F.linear(x[..., :24], w2))


def test_the_op_falls_back_to_the_reference_on_cpu():
    torch.manual_seed(0)
    x, w, g, r = torch.randn(1, 64).bfloat16(), torch.randn(40, 64).bfloat16(), torch.randn(64).bfloat16(), \
        torch.randn(1, 40).bfloat16()
    assert not gemv_row.applies(x, w)  # a CPU tensor
    assert torch.equal(gemv_row.linear(x, w, g, r), gemv_row.row_reference(x, w, g, r))
    assert torch.equal(torch.ops.paratron.gemv_row(x, w, g, None, True, 1e-6, False),
                       gemv_row.row_reference(x, w, g, None, True, 1e-6))
    with torch._subclasses.FakeTensorMode():  # the fake kernel the compiled step traces
        fx, fw = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(40, 64, dtype=torch.bfloat16)
        assert torch.ops.paratron.gemv_row(fx, fw, None, None, True, 1e-5, False).shape == (1, 20)
        assert torch.ops.paratron.gemv_row(fx, fw, None, None, False, 1e-5, False).shape == (1, 40)


INTERPRET = r"""
import torch
from paratron.kernels import gemv_row
torch.manual_seed(0)

def err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()

# (n, k, norm, residual, gated, bias): n off every row block, k off every column block
cases = ((40, 96, False, False, False, True), (40, 1100, True, True, False, False),
         (24, 600, True, False, True, True), (7, 2100, False, True, False, False), (33, 256, True, False, True, False),
         (40, 1100, True, False, False, True))
# fp16 rounds as the GPU does, every block shape; the interpreter truncates fp32 to bf16 (the GPU rounds to nearest),
# whence bf16's looser bound, one block shape
for dtype, bound, configs in ((torch.float16, 2e-3, gemv_row.CONFIGS), (torch.bfloat16, 4e-2, gemv_row.CONFIGS[:1])):
    for n, k, norm, res, gated, has_bias in cases:
        x = torch.randn(1, k).to(dtype)
        w = (torch.randn(n * (2 if gated else 1), k) * k ** -0.5).to(dtype)
        g = (1 + 0.1 * torch.randn(k)).to(dtype) if norm else None
        r = torch.randn(1, n).to(dtype) if res else None
        b = torch.randn(n * (2 if gated else 1)).to(dtype) if has_bias else None
        want = gemv_row.row_reference(x, w, g, r, gated, 1e-5, b)
        for config in configs:
            got = gemv_row.launch(x, w, g, r, gated, 1e-5, config=config.kwargs, bias=b)
            assert got.shape == want.shape and got.dtype == dtype, (n, k)
            assert err(got, want) < bound, (dtype, n, k, norm, res, gated, has_bias, config.kwargs, err(got, want))
        if dtype == torch.float16:  # at early_config's (two blocks ahead; the interpreter has no PDL wait to run)
            got = gemv_row.launch(x, w, g, r, gated, 1e-5, config=gemv_row.early_config(n, k), bias=b)
            assert err(got, want) < bound, ("early", n, k, err(got, want))
            for config in gemv_row.CONFIGS[:3]:  # two ahead at shapes whose K spans one, two, or more blocks
                got = gemv_row.launch(x, w, g, r, gated, 1e-5, config={**config.kwargs, "AHEAD": 2}, bias=b)
                assert err(got, want) < bound, ("two ahead", n, k, config.kwargs, err(got, want))
print("ok")
"""


def test_row_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(INTERPRET)


def test_early_launches_take_four_rows_by_1024_columns_and_eight_warps_on_narrow_layers(monkeypatch):
    pytest.importorskip("triton")
    deep = {"AHEAD": 2, "POLICY": "evict_first"}
    assert gemv_row.early_config(2048, 8192) == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 8, **deep}  # fc2
    assert gemv_row.early_config(3072, 2048) == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, **deep}  # qkv
    assert gemv_row.early_config(40, 96) == {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, **deep}
    launched = []

    class Kernel:  # records what the launch asks of the kernel
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, kw))
    monkeypatch.setattr(gemv_row, "_row_kernel", Kernel())
    x, w = torch.randn(1, 8192).half(), torch.randn(2048, 8192).half()
    gemv_row.launch(x, w, None, None, False, 1e-5, pdl=True)
    (grid, kw), = launched
    assert grid == (512,) and kw["PDL"] and kw["launch_pdl"]
    assert (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["AHEAD"], kw["POLICY"]) == (4, 1024, 8, 2, "evict_first")


def _tiny(extra=(), attention="fused"):
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--config", "tiny", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
                      "rope", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--init-method-std", "0.3", "--mock-data", *extra])
    torch.manual_seed(0)
    kernels = dataclasses.replace(cfg.kernels, kernel_decode_attention=attention)
    return GPTModel(cfg.model, cfg.padded_vocab_size, kernels=kernels).eval(), cfg.data.vocab_size


def _tokens(model, vocab, rows, monkeypatch=None, calls=None):
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    engine = Engine(model, vocab, eod=None)
    plain = [r.tokens for r in engine.generate([Request([5, 6, 7, 8 + i], SamplingParams(6)) for i in range(rows)])]
    if monkeypatch is not None:
        real = gemv_row.linear
        monkeypatch.setattr(gemv_row, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine.gemv = "triton"  # what --kernel-decode-gemv triton sets on a GPU
    return plain, [r.tokens for r in engine.generate([Request([5, 6, 7, 8 + i], SamplingParams(6))
                                                      for i in range(rows)])]


@pytest.mark.parametrize("extra", [(), ("--qk-layernorm",), ("--add-qkv-bias",)])
def test_a_batch_1_decode_step_runs_each_layer_as_four_row_gemvs(monkeypatch, extra):
    """On CPU the row GEMV is its reference and the fused attention its torch reference: the same greedy tokens as the
    per-module path, with four row GEMVs a layer and one for the final norm and the output layer a decode step; two
    rows keep the per-module path. Qwen3-style query / key norms run inside the fused attention, Qwen2's qkv bias in
    the qkv row GEMV."""
    model, vocab = _tiny(extra)
    with torch.no_grad():  # (a bias that matters: the layers' start at zero)
        for layer in model.decoder.layers:
            if layer.self_attention.linear_qkv.bias is not None:
                layer.self_attention.linear_qkv.bias.normal_(0, 0.5)
    assert all(layer.decode_rows for layer in model.decoder.layers)
    calls = []
    plain, rows = _tokens(model, vocab, 1, monkeypatch, calls)
    # 5 decode steps after the prefill: four a layer and the output layer (with the final norm)
    assert rows == plain and len(calls) == 5 * (4 * model.config.num_layers + 1)
    calls.clear()
    plain, rows = _tokens(model, vocab, 2, monkeypatch, calls)
    assert rows == plain and not calls


@pytest.mark.parametrize("extra,attention", [(("--normalization", "LayerNorm"), "fused"),
                                             (("--apply-layernorm-1p",), "fused"),
                                             ((), "sdpa"), (("--qk-layernorm", "--apply-layernorm-1p"), "fused")])
def test_layers_the_row_path_cannot_take_keep_the_per_module_path(extra, attention):
    model, _ = _tiny(extra, attention)
    assert not any(layer.decode_rows for layer in model.decoder.layers)


def test_one_row_of_the_gemv_switch_goes_to_the_row_kernel(monkeypatch):
    seen = []
    monkeypatch.setattr(gemv, "applies", lambda *a: True)
    monkeypatch.setattr(gemv_row, "applies", lambda *a: True)
    monkeypatch.setattr(gemv_row, "linear", lambda *a, **k: seen.append(k) or a[0])
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    gemv.linear(x, w)
    gemv.swiglu(x, w)
    assert seen == [{"residual": None}, {"gated": True}]


def test_auto_takes_the_gemvs_and_launches_early_only_where_layers_run_as_row_gemvs():
    from paratron.inference.engine import Engine
    model, vocab = _tiny()
    engine = Engine(model, vocab, eod=None)
    assert engine.gemv == "torch" and engine.decode_pdl() == "off"  # (auto off CUDA: torch)
    engine.gemv = "auto"  # as on a GPU
    assert engine.decode_pdl() == "auto" and engine.gemv_at(1) and not engine.gemv_at(2)
    model, vocab = _tiny(("--normalization", "LayerNorm"))
    engine = Engine(model, vocab, eod=None)
    engine.gemv = "auto"
    # no layer runs as row GEMVs: auto keeps Inductor's kernels, launched as before
    assert engine.decode_pdl() == "off" and not engine.gemv_at(1)
    engine.gemv = "triton"
    assert engine.gemv_at(1) and engine.gemv_at(8)


def test_under_auto_layers_that_cannot_run_as_row_gemvs_keep_torchs_linears(monkeypatch):
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    from paratron.kernels import gemv
    model, vocab = _tiny(("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                          "--moe-layer-freq", "[0,1]"))  # layer 0 dense (row GEMVs), layer 1 MoE (not)
    engine = Engine(model, vocab, eod=None)
    plain = engine.generate([Request([5, 6, 7], SamplingParams(4))])[0].tokens
    calls = {"row": 0, "gemv": 0}
    real_row, real_linear = gemv_row.linear, gemv.linear
    monkeypatch.setattr(gemv_row, "linear", lambda *a, **k: calls.__setitem__("row", calls["row"] + 1)
                        or real_row(*a, **k))
    monkeypatch.setattr(gemv, "linear", lambda *a, **k: calls.__setitem__("gemv", calls["gemv"] + 1)
                        or real_linear(*a, **k))
    for mode in ("auto", "triton"):
        engine.gemv = mode  # as on a GPU
        calls.update(row=0, gemv=0)
        assert engine.generate([Request([5, 6, 7], SamplingParams(4))])[0].tokens == plain, mode
        assert calls["row"] > 0, (mode, calls)  # the dense layer (and the output layer) as row GEMVs
        # auto: the MoE layer's attention keeps torch's linears; triton sends them through the GEMV kernels
        assert (calls["gemv"] > 0) == (mode == "triton"), (mode, calls)


def test_rows_the_kernel_cannot_read_take_the_reference(monkeypatch):
    """A row with a stride, a residual of another dtype: the kernel (unit strides, one dtype) is not called."""
    monkeypatch.setattr(gemv_row, "triton", object())  # as if Triton were there; the tensors still say CPU
    x, w = torch.randn(1, 16).bfloat16(), torch.randn(8, 8).bfloat16()
    strided = x[:, ::2]
    assert strided.stride(-1) == 2 and not gemv_row.applies(strided, w)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert gemv_row.applies(x[:, :8], w) and not gemv_row.applies(strided, w)
    monkeypatch.setattr(torch.ops.paratron, "gemv_row", None)  # the op would fail if reached
    r = torch.randn(1, 8)  # fp32 residual
    assert torch.equal(gemv_row.linear(x[:, :8], w, residual=r), gemv_row.row_reference(x[:, :8], w, residual=r))
