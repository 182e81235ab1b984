"""The decode GEMV (paratron/kernels/gemv.py): its torch references, the custom op's CPU kernel (the reference),
the Triton kernel through Triton's CPU interpreter against F.linear (every config of its tuning list, K split and
not, n not a multiple of the row block, 1..8 rows, fc1's fused SwiGLU), and the --kernel-decode-gemv switch."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from paratron.config.kernels import CHOICES, KernelConfig
from paratron.errors import ConfigError
from paratron.kernels import gemv, switches


def test_references_are_the_linear_layer_and_the_gated_mlp():
    torch.manual_seed(0)
    x, w, b, r = torch.randn(3, 5, 32), torch.randn(12, 32), torch.randn(12), torch.randn(3, 5, 12)
    torch.testing.assert_close(gemv.linear_reference(x, w, b, r), x @ w.T + b + r)
    gate, up = w[:6], w[6:]
    torch.testing.assert_close(gemv.swiglu_reference(x, w), F.silu(x @ gate.T) * (x @ up.T))


def test_the_op_falls_back_to_the_reference_on_cpu():
    torch.manual_seed(0)
    x, w, b, r = torch.randn(4, 64).bfloat16(), torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16(), \
        torch.randn(4, 40).bfloat16()
    assert not gemv.applies(x, w)  # a CPU tensor: the public functions take the reference
    assert torch.equal(gemv.linear(x, w, b, r), gemv.linear_reference(x, w, b, r))
    assert torch.equal(gemv.swiglu(x[None], w), gemv.swiglu_reference(x[None], w))
    assert torch.equal(torch.ops.paratron.gemv(x, w, b, r, False), gemv.linear_reference(x, w, b, r))
    assert torch.equal(torch.ops.paratron.gemv(x, w, b, None, True), gemv.swiglu_reference(x, w, b))
    with torch._subclasses.FakeTensorMode():  # the fake kernel the compiled step traces
        fx, fw = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(40, 64, dtype=torch.bfloat16)
        assert torch.ops.paratron.gemv(fx, fw, None, None, True).shape == (4, 20)
        assert torch.ops.paratron.gemv(fx, fw, None, None, False).shape == (4, 40)


def test_split_k_fills_the_gpu_and_keeps_wide_spans():
    assert gemv.split_k(128256, 2048, 132) == 1  # the output layer: thousands of row blocks already
    assert gemv.split_k(2048, 8192, 132) == 8  # fc2 of llama-1b: 64 row blocks
    assert gemv.split_k(2048, 2048, 132) == 4  # no split narrower than 512 columns (64 x 4 < 2 x 132)
    assert gemv.split_k(64, 100, 132) == 1


def test_switch_auto_takes_the_row_kernels_at_one_row_on_a_gpu_and_triton_is_refused_on_cpu():
    from paratron.config.kernels import decode_rows, pdl_at
    assert CHOICES["kernel_decode_gemv"] == ("auto", "triton", "torch")
    cpu = switches.resolve(KernelConfig(), "cpu", torch.float32)
    assert (cpu.kernel_decode_gemv, cpu.kernel_decode_pdl) == ("torch", "off")
    gpu = switches.offer_of_kind(hopper_bf16=True)
    on_gpu = switches.resolve(KernelConfig(), "cpu", torch.bfloat16, offered=gpu)
    assert (on_gpu.kernel_decode_gemv, on_gpu.kernel_decode_pdl) == ("auto", "auto")  # decided per step's rows
    assert switches.device_resolved(on_gpu)
    plain = dataclasses.replace(KernelConfig(), kernel_decode_gemv="torch")  # Inductor alone: not launched early
    assert switches.resolve(plain, "cpu", torch.bfloat16, offered=gpu).kernel_decode_pdl == "off"
    older = switches.offer_of_kind(hopper_bf16=False)  # no programmatic dependent launch before Hopper
    assert switches.resolve(KernelConfig(), "cpu", torch.bfloat16, offered=older).kernel_decode_pdl == "off"
    assert [decode_rows("auto", r) for r in (1, 2)] == [True, False] and decode_rows("triton", 8)
    assert not decode_rows("torch", 1) and [pdl_at("auto", r) for r in (1, 4)] == [True, False] and pdl_at("on", 4)
    asked = dataclasses.replace(KernelConfig(), kernel_decode_gemv="triton")
    assert switches.resolve(asked, "cpu", torch.bfloat16, offered=gpu).kernel_decode_gemv == "triton"
    with pytest.raises(ConfigError, match="--kernel-decode-gemv triton"):
        switches.resolve(asked, "cpu", torch.float32)


INTERPRET = r"""
import torch
from paratron.kernels import gemv
torch.manual_seed(0)

def check(got, want, what):
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and err < 1e-2, (what, err)

# (m, n, k, gated, bias, residual, split): n not a multiple of any row block, k not one of any column block
cases = ((1, 40, 96, False, False, False, 1), (3, 40, 1100, False, True, True, 4),
         (8, 24, 600, True, False, False, 2), (5, 24, 256, True, True, False, 1), (2, 70, 300, False, False, True, 3))
for m, n, k, gated, bias, res, split in cases:
    x = torch.randn(m, k).bfloat16()
    w = (torch.randn(n * (2 if gated else 1), k) * k ** -0.5).bfloat16()
    b = torch.randn(w.size(0)).bfloat16() if bias else None
    r = torch.randn(m, n).bfloat16() if res else None
    want = gemv.swiglu_reference(x, w, b) if gated else gemv.linear_reference(x, w, b, r)
    for config in gemv.CONFIGS:
        got = gemv.launch(x, w, b, r, gated, split=split, config=config.kwargs)
        check(got, want, (m, n, k, gated, split, config.kwargs))

# split K leaves its workspace zeroed: a second launch over the same buffers gives the same output
m, n, k = 3, 40, 1100
x, w = torch.randn(m, k).bfloat16(), (torch.randn(n, k) * 0.03).bfloat16()
out = torch.empty(m, n, dtype=torch.bfloat16)
buf = torch.zeros(m * n + -(-n // gemv.MIN_BLOCK_N), dtype=torch.int32)
ws, cnt = buf[:m * n].view(torch.float32), buf[m * n:]
outs = []
for _ in range(2):
    gemv._gemv_kernel[(-(-n // 16), 4)](x, w, x, x, out, ws, cnt, m, n, k, k, 0, n, HAS_BIAS=False, HAS_RES=False,
                                        GATED=False, SPLIT_K=4, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128)
    assert torch.count_nonzero(buf) == 0
    outs.append(out.clone())
assert torch.equal(outs[0], outs[1])
check(outs[0], torch.nn.functional.linear(x, w), "reused workspace")
print("ok")
"""


def test_gemv_kernel_matches_f_linear_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(INTERPRET)


def _tiny_model(kernel: str = "auto"):
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--config", "tiny", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
                      "rope", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--init-method-std", "0.3", "--mock-data"])
    torch.manual_seed(0)
    kernels = dataclasses.replace(cfg.kernels, kernel_decode_gemv=kernel)
    return GPTModel(cfg.model, cfg.padded_vocab_size, kernels=kernels).eval(), cfg.data.vocab_size


def test_decode_steps_reach_the_gemv_and_only_they(monkeypatch):
    """The decode step with the switch's flag set calls kernels/gemv.py for every dense linear layer (on CPU its
    reference: the same tokens); prefill never does; triton is refused by name off CUDA."""
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    model, vocab = _tiny_model()
    engine = Engine(model, vocab, eod=None)
    assert engine.gemv == "torch"  # (auto off CUDA)
    reqs = [Request([5, 6, 7, 8], SamplingParams(6)), Request([9, 3], SamplingParams(6))]
    plain = [r.tokens for r in engine.generate(reqs)]
    calls = []
    for name in ("linear", "swiglu"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    engine.gemv = "triton"  # what --kernel-decode-gemv triton sets on a GPU
    assert [r.tokens for r in engine.generate(reqs)] == plain
    layers = model.config.num_layers
    # per decode step: qkv, proj and fc2 linear, fc1 + SwiGLU fused, the output layer; 5 steps after the prefill
    assert calls.count("swiglu") == 5 * layers and calls.count("linear") == 5 * (3 * layers + 1)
    with pytest.raises(ConfigError, match="--kernel-decode-gemv triton"):
        Engine(_tiny_model("triton")[0], vocab, eod=None)
