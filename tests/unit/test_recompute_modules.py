"""--recompute-granularity selective --recompute-modules: each named submodule really runs again in
backward (its forward is counted), and the gradients equal those of the run without recomputation."""
import pytest
import torch

from paratron.config import ConfigError, parse_args
from paratron.model import layers, moe
from paratron.model.attention import SDPAttention
from paratron.model.mla import MLASelfAttention
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
    "mla_up_proj": (MLASelfAttention, "_up"),
}
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--position-embedding-type", "rope", "--qk-layernorm"]


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
    (BASE + MLA + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"], ["mla_up_proj"]),
    (BASE + MLA[:3] + MLA[5:] + ["--kv-lora-rank", "16", "--attention-dropout", "0.1"], ["mla_up_proj"]),  # no q LoRA
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
    for extra, match in ((["--recompute-modules", "mla_up_proj"], "mla_up_proj .* needs --multi-latent-attention"),
                         (["--recompute-modules", "mhc"], "hyper-connections"),
                         (["--recompute-modules", "core"], "choose from"),
                         (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-modules",
                           "mlp"], "needs --recompute-granularity selective")):
        with pytest.raises(ConfigError, match=match):
            parse_args(BASE + (extra if "full" in extra else ["--recompute-granularity", "selective"] + extra))
    with pytest.raises(ConfigError, match="mla_up_proj with --fp8-recipe delayed"):
        parse_args(BASE + MLA + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                 "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"])
    with pytest.raises(ConfigError, match="needs --moe-grouped-gemm"):
        parse_args(BASE + ["--num-experts", "4", "--recompute-granularity", "selective", "--recompute-modules",
                           "moe_act"])


def test_mla_up_proj_keeps_less(monkeypatch):
    """--recompute-modules mla_up_proj: the per-head queries, keys and values a core keeps for backward are not kept
    (recomputed from the latents when its backward needs them). The core here is plain matmuls, which keep q, k
    and v themselves, as the GPU's attention kernels do (the CPU's SDPA keeps copies of its own instead)."""
    def core(self, q, k, v, ctx):
        return torch.matmul(torch.matmul(q, k.transpose(-2, -1)).tril().softmax(-1), v)
    monkeypatch.setattr(MLASelfAttention, "_core", core)
    argv = BASE + MLA + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--recompute-granularity",
                         "selective", "--recompute-modules"]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def kept(modules):
        model = build_model(parse_args(argv + modules), ParallelDims(), torch.device("cpu"))
        attn = model.decoder.layers[0].self_attention
        assert attn.recompute_up == ("mla_up_proj" in modules) and attn.recompute_core == ("core_attn" in modules)
        params, held = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

        def pack(t):  # (each storage held until counted: freed memory reused by another tensor is not missed)
            if t.untyped_storage().data_ptr() not in params:
                held.setdefault(t.untyped_storage().data_ptr(), t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels=tokens).mean()
        total = sum(t.untyped_storage().nbytes() for t in held.values())
        loss.backward()
        return total
    m = parse_args(argv + ["mlp"]).model  # (not layernorm: its hooks, around the attention, would hide what it saves)
    qkv = 2 * 16 * m.num_attention_heads * (2 * (m.qk_head_dim + m.qk_pos_emb_head_dim) + m.v_head_dim) * 4
    assert kept(["mlp"]) - kept(["mlp", "mla_up_proj"]) >= m.num_layers * qkv
