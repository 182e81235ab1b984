"""--recompute-granularity selective --recompute-modules: each named submodule really runs again in
backward (its forward is counted), and the gradients equal those of the run without recomputation."""
import pytest
import torch

from paratron.config import ConfigError, parse_args
from paratron.model import layers, moe
from paratron.model.attention import SDPAttention
from paratron.parallel.dims import ParallelDims
from paratron.train.step import build_model

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3", "--train-iters", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-grouped-gemm",
       "--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "0.01", "--swiglu"]
COUNTED = {  # module name -> (class, method) whose calls show the recomputation
    "core_attn": (SDPAttention, "core"), "layernorm": (layers.Norm, "forward"), "mlp": (layers.MLP, "forward"),
    "moe": (moe.Router, "forward"), "shared_experts": (layers.MLP, "forward"), "moe_act": (moe.Experts, "_act"),
}


def grads(argv, count=None, monkeypatch=None):
    """Parameter gradients of one forward/backward (and how often ``count``'s method ran)."""
    cfg = parse_args(argv)
    model = build_model(cfg, ParallelDims(), torch.device("cpu"))
    calls = []
    if count is not None:
        cls, meth = COUNTED[count]
        inner = getattr(cls, meth)
        monkeypatch.setattr(cls, meth, lambda self, *a, **k: calls.append(1) or inner(self, *a, **k))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    torch.manual_seed(11)  # the dropout masks
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    metrics = {k: float(v[0]) for r in moe.routers([model]) for k, v in r.metrics.items()}
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls), metrics


@pytest.mark.parametrize("argv,names", [
    (BASE + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"], ["core_attn", "layernorm", "mlp"]),
    (BASE + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"], ["layernorm", "mlp"]),  # fused residual
    (BASE + MOE + ["--hidden-dropout", "0.0"], ["moe", "shared_experts", "moe_act", "layernorm", "core_attn"]),
])
def test_recomputed_modules_give_the_same_gradients(argv, names, monkeypatch):
    ref, _, ref_metrics = grads(argv)
    for name in names:
        with monkeypatch.context() as m:
            _, plain_calls, _ = grads(argv, name, m)
        with monkeypatch.context() as m:
            got, calls, metrics = grads(argv + ["--recompute-granularity", "selective", "--recompute-modules", name],
                                        name, m)
        assert calls > plain_calls, f"{name}: not recomputed ({calls} calls, {plain_calls} without)"
        assert got.keys() == ref.keys()
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=f"{name}: {n}")
        assert metrics == ref_metrics  # a recomputed router does not count its losses twice


def test_default_and_refused_modules():
    assert parse_args(BASE + ["--recompute-activations"]).train.recompute_modules == ["core_attn"]
    assert parse_args(BASE + ["--recompute-granularity", "selective", "--recompute-modules", "[layernorm", "mlp]"]
                      ).train.recompute_modules == ["layernorm", "mlp"]  # Megatron's YAML configs' spelling
    for extra, match in ((["--recompute-modules", "mla_up_proj"], "multi-latent attention"),
                         (["--recompute-modules", "mhc"], "hyper-connections"),
                         (["--recompute-modules", "core"], "choose from"),
                         (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-modules",
                           "mlp"], "needs --recompute-granularity selective")):
        with pytest.raises(ConfigError, match=match):
            parse_args(BASE + (extra if "full" in extra else ["--recompute-granularity", "selective"] + extra))
    with pytest.raises(ConfigError, match="needs --moe-grouped-gemm"):
        parse_args(BASE + ["--num-experts", "4", "--recompute-granularity", "selective", "--recompute-modules",
                           "moe_act"])
