"""On CUDA: flash-linear-attention's chunked kernels (--kernel-linear-scan fla, kernels/linear_scan.py) against the
torch references for Mamba-2's SSD and the gated delta rule, forward and gradients, with packed documents; the
decode step from the prefill's states; a hybrid model's training step on fla equal to the torch path."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (benchmarks/README.md)")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@needs_fla
@pytest.mark.parametrize("kind", ["ssd", "gdn"])
@pytest.mark.parametrize("docs", [1, 3])
def test_fla_equals_reference(kind, docs):
    from benchmarks.matmul_shapes import scan_inputs
    from paratron.kernels.linear_scan import gated_delta, ssd
    fn = ssd if kind == "ssd" else gated_delta
    torch.manual_seed(0)
    x, reset = scan_inputs(kind, 2, 512, torch.device("cuda"), docs=docs)
    reset = reset if docs > 1 else None
    from paratron.kernels.linear_scan import fla_refusal
    grads = fla_refusal() is None  # fla-core refuses its own gated backward with some Triton versions on Hopper
    outs = {}
    for k in ("torch", "fla"):
        leaves = {n: t.clone().requires_grad_(grads) for n, t in x.items()}
        y, final = fn(**leaves, reset=reset, kernel=k)
        outs[k] = [y.detach(), final.detach()]  # the final state of each row (its last document's, when packed)
        if grads:
            outs[k] += torch.autograd.grad((y * y).sum(), list(leaves.values()))
    for a, b in zip(outs["fla"], outs["torch"]):
        assert _rel(a, b) < 2e-3


def test_fla_refusal_reaches_the_switches():
    """Where fla-core cannot train (its own check), auto runs the torch scans and an explicit fla is refused by
    name before anything is built."""
    from paratron.config.kernels import KernelConfig
    from paratron.errors import ConfigError
    from paratron.kernels import switches
    from paratron.kernels.linear_scan import fla_installed, fla_refusal
    if not (fla_installed() and fla_refusal()):
        pytest.skip("fla-core installed and trainable here")
    assert switches.resolve(KernelConfig(), "cuda", torch.bfloat16).kernel_linear_scan == "torch"
    with pytest.raises(ConfigError, match="Triton"):
        switches.resolve(KernelConfig(kernel_linear_scan="fla"), "cuda", torch.bfloat16)


@needs_fla
@pytest.mark.parametrize("kind", ["ssd", "gdn"])
def test_decode_continues_the_fla_prefill(kind):
    """The final state of fla's prefill, then one sequential step, equals the reference over the whole sequence."""
    from benchmarks.matmul_shapes import scan_inputs
    from paratron.kernels.linear_scan import gated_delta, ssd
    fn = ssd if kind == "ssd" else gated_delta
    torch.manual_seed(1)
    x, _ = scan_inputs(kind, 2, 129, torch.device("cuda"))
    full = fn(**x, kernel="torch")[0]
    _, state = fn(**{n: t[:, :128] if t.dim() > 1 else t for n, t in x.items()}, kernel="fla")
    step = fn(**{n: t[:, 128:] if t.dim() > 1 else t for n, t in x.items()}, state=state, kernel="fla")[0]
    assert _rel(step[:, 0], full[:, 128]) < 2e-3


@needs_fla
def test_hybrid_training_step_fla_equals_torch():
    from paratron.kernels.linear_scan import fla_refusal
    if fla_refusal():
        pytest.skip(fla_refusal())
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    flags = ["--hybrid-layer-pattern", "MG*-", "--hidden-size", "256", "--num-attention-heads", "4",
             "--mamba-head-dim", "64", "--mamba-num-groups", "2", "--linear-num-key-heads", "2",
             "--linear-num-value-heads", "4", "--linear-key-head-dim", "64", "--linear-value-head-dim", "64",
             "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
             "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-3", "--bf16", "--device", "cuda", "--normalization", "RMSNorm",
             "--position-embedding-type", "none", "--disable-bias-linear"]
    losses = {}
    for k in ("torch", "fla"):
        t = Trainer(parse_args(flags + ["--kernel-linear-scan", k]))
        losses[k] = [float(r[0] / r[1]) for r, _, _ in (t.train_step() for _ in range(3))]
        t.close()
    for a, b in zip(losses["fla"], losses["torch"]):
        assert abs(a - b) <= 2e-2 * abs(b), losses


def test_hybrid_generation_compiled_equals_eager():
    """A hybrid stack's greedy tokens with the compiled decode step (a CUDA graph over the recurrent states) equal
    the eager engine's."""
    from paratron.config import ModelConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    from paratron.model.gpt import GPTModel
    cfg = ModelConfig(hybrid_layer_pattern="MG*-", hidden_size=128, num_attention_heads=4, normalization="RMSNorm",
                      position_embedding_type="none", disable_bias_linear=True, mamba_head_dim=32, mamba_num_groups=2,
                      mamba_state_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                      linear_value_head_dim=32, init_method_std=0.3, hidden_dropout=0.0,
                      attention_dropout=0.0).resolved()
    torch.manual_seed(0)
    model = GPTModel(cfg, 256, device="cuda", dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 40, 41]]
    out = {}
    for compiled in (False, True):
        engine = Engine(model, 256, compile=compiled)
        out[compiled] = [r.tokens for r in engine.generate([Request(p, SamplingParams(max_new_tokens=8))
                                                            for p in prompts])]
    assert out[True] == out[False]


@pytest.mark.parametrize("kind", ["ssd", "gdn"])
def test_compiled_torch_scan_equals_the_recurrence(kind):
    """The path a hybrid model trains on where fla-core cannot (Hopper with torch 2.11's Triton): the chunked torch
    scan with its products recomputed in backward, compiled, against the sequential recurrence on the GPU, both in
    fp32 as the mixers run them: outputs, final states and the inputs' gradients, three packed documents per row."""
    from benchmarks.matmul_shapes import scan_inputs
    from paratron.kernels.gated_delta import gated_delta_sequential
    from paratron.kernels.linear_scan import gated_delta, ssd
    from paratron.kernels.ssd import ssd_sequential
    torch.manual_seed(0)
    x, reset = scan_inputs(kind, 2, 256, torch.device("cuda"), docs=3)
    fn, ref = (ssd, ssd_sequential) if kind == "ssd" else (gated_delta, gated_delta_sequential)
    fast = torch.compile(lambda **kw: fn(**kw, reset=reset, kernel="torch", recompute=True), fullgraph=True)
    outs = {}
    for name, run in (("fast", fast), ("ref", lambda **kw: ref(**kw, reset=reset))):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        y, final = run(**leaves)
        outs[name] = [y.detach(), final.detach()] + list(torch.autograd.grad((y * y).sum(), list(leaves.values())))
    for a, b in zip(outs["fast"], outs["ref"]):
        assert _rel(a, b) < 2e-3  # TF32 off (torch's default): the chunking's summation order only


@needs_fla
@pytest.mark.parametrize("kind", ["ssd", "gdn"])
def test_fla_packed_documents_with_states_equal_reference(kind):
    """The paged engine's packed prompt chunks on fla (``cu_seqlens`` and a state per document) against the torch
    reference (kernels/varlen.py): outputs and every document's final state, lengths 1, off and on the chunk."""
    from benchmarks.matmul_shapes import scan_inputs
    from paratron.kernels.linear_scan import gated_delta, ssd
    fn = ssd if kind == "ssd" else gated_delta
    torch.manual_seed(2)
    lengths = [1, 70, 64, 3, 200, 1, 129]
    x, _ = scan_inputs(kind, 1, sum(lengths), torch.device("cuda"))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    shape = fn(**{n: t[:, :2] if t.dim() > 1 else t for n, t in x.items()}, kernel="torch")[1].shape[1:]
    state = torch.randn(len(lengths), *shape, device="cuda") * 0.1
    ref = fn(**x, state=state, cu_seqlens=cu, kernel="torch")
    got = fn(**x, state=state, cu_seqlens=cu, kernel="fla")
    for a, b in zip(got, ref):
        assert a.shape == b.shape and _rel(a, b) < 2e-3


@pytest.mark.parametrize("kind", ["ssd", "gdn"])
def test_packed_documents_read_nothing_back_with_host_offsets(kind):
    """The paged engine keeps a packed pass's offsets on the host: the torch scans and the packed convolution then
    run without a host synchronisation (CUDA's sync debug mode raises on one)."""
    from benchmarks.matmul_shapes import scan_inputs
    from paratron.kernels.causal_conv import causal_conv_varlen
    from paratron.kernels.linear_scan import gated_delta, ssd
    fn = ssd if kind == "ssd" else gated_delta
    torch.manual_seed(3)
    lengths = [1, 70, 3]
    x, _ = scan_inputs(kind, 1, sum(lengths), torch.device("cuda"))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    conv_in, weight = torch.randn(1, sum(lengths), 8, device="cuda"), torch.randn(8, 1, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(**x, cu_seqlens=cu, kernel="torch")
        conv = causal_conv_varlen(conv_in, weight, None, cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = fn(**x, cu_seqlens=cu.cuda(), kernel="torch")
    assert all(torch.equal(a, b) for a, b in zip(out, ref)) and conv[0].shape == conv_in.shape
