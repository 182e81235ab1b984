"""Megatron's variants (issue 19): zero-centred norms, squared ReLU, quick-GeGLU with offset and clamp
(against transformers' gpt-oss), the attention output gate, Megatron's weight-decay and decoupled-LR
parameter groups, the Muon optimizer, the bf16 matmul switch, and their one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from paratron.config import Config, ConfigError, ModelConfig, finalize
from paratron.model.gpt import GPTModel
from paratron.model.layers import Attention, ForwardContext, Norm, Parallel
from paratron.model.variants import glu, mlp_activation, quick_gelu, squared_relu
from paratron.optim.groups import role_of
from paratron.optim.muon import Item, Muon, coefficients, fp32_matmul_precision, newton_schulz, qkv_rows, scale_factor
from paratron.optim.optimizer import Optimizer
from paratron.optim.schedule import LRScheduler
from paratron.parallel.dims import ParallelDims


def model_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                attention_dropout=0.0)
    return ModelConfig(**{**base, **kw}).resolved()


def run_cfg(**kw) -> Config:
    cfg = Config()
    cfg.train.train_iters, cfg.optim.lr, cfg.data.mock_data, cfg.data.vocab_size = 4, 1e-2, True, 64
    for k, v in kw.items():
        cfg.set(k, v)
    return finalize(cfg, 1)


# ---- --apply-layernorm-1p -------------------------------------------------------------------------
def test_zero_centred_rmsnorm_by_hand():
    n = Norm("RMSNorm", 2, 0.0, zero_centered=True)
    assert n.weight.tolist() == [0.0, 0.0]
    with torch.no_grad():
        n.weight.copy_(torch.tensor([0.5, -0.5]))
    # x = [3, 4]: rms = sqrt(12.5); x / rms = [0.84853, 1.13137]; times 1 + w = [1.5, 0.5]
    assert n(torch.tensor([[3.0, 4.0]])).tolist()[0] == pytest.approx([1.272792, 0.565685], rel=1e-5)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norm_is_the_plain_norm_with_one_plus_w(kind):
    w, b, x = torch.randn(8), torch.randn(8), torch.randn(3, 8)
    zc, plain = Norm(kind, 8, 1e-5, zero_centered=True), Norm(kind, 8, 1e-5)
    with torch.no_grad():
        zc.weight.copy_(w), plain.weight.copy_(1 + w)
        if kind == "LayerNorm":
            zc.bias.copy_(b), plain.bias.copy_(b)
    torch.testing.assert_close(zc(x), plain(x))


def test_layernorm_1p_model_starts_as_the_plain_model():
    """Every norm (layers, q/k, final) starts at w = 0, i.e. gamma = 1: the same outputs as without 1p."""
    x = torch.randint(0, 64, (2, 16))
    a = GPTModel(model_cfg(apply_layernorm_1p=True, qk_layernorm=True, normalization="RMSNorm"), 64, seed=3)
    b = GPTModel(model_cfg(qk_layernorm=True, normalization="RMSNorm"), 64, seed=3)
    norms = [p for n, p in a.named_parameters() if "layernorm" in n]
    assert len(norms) == 2 * 4 + 1 and all(float(p.detach().abs().sum()) == 0.0 for p in norms)
    torch.testing.assert_close(a(x, labels=x), b(x, labels=x))


# ---- activations ----------------------------------------------------------------------------------
def test_squared_relu_and_quick_gelu_by_hand():
    x = torch.tensor([-2.0, 0.5, 3.0])
    assert squared_relu(x).tolist() == [0.0, 0.25, 9.0]
    assert quick_gelu(torch.tensor([1.0])).item() == pytest.approx(1.0 / (1.0 + math.exp(-1.702)))
    assert mlp_activation(model_cfg(squared_relu=True))(x).tolist() == [0.0, 0.25, 9.0]


def test_quick_geglu_with_offset_and_clamp_equals_transformers_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    hf = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=1))
    assert (hf.alpha, hf.limit) == (1.702, 7.0)
    gate, up = torch.randn(5, 6) * 6, torch.randn(5, 6) * 6  # some beyond the limit of 7
    interleaved = torch.stack([gate, up], dim=-1).reshape(5, 12)  # HF's [g0, u0, g1, u1, ...]
    act = mlp_activation(model_cfg(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0))
    torch.testing.assert_close(act(torch.cat([gate, up], -1)), hf._apply_gate(interleaved))


def test_glu_clamps_then_offsets_by_hand():
    h = torch.tensor([[10.0, -1.0, 9.0, -9.0]])  # gate [10, -1], linear [9, -9]; clamp 2: [2, -1], [2, -2]
    out = glu(h, lambda g: g, offset=0.5, clamp=2.0)
    assert out.tolist() == [[2.0 * 2.5, -1.0 * -1.5]]


def test_gated_mlp_widths():
    m = GPTModel(model_cfg(quick_geglu=True, ffn_hidden_size=48), 64)
    assert m.decoder.layers[0].mlp.linear_fc1.weight.shape == (96, 32)


# ---- attention output gate ------------------------------------------------------------------------
def test_attention_output_gate_equals_a_hand_written_reference():
    cfg = model_cfg(attention_output_gate=True, group_query_attention=True, num_query_groups=2,
                    disable_bias_linear=True)
    att = Attention(cfg, Parallel())
    d, g, qpg = cfg.kv_channels, 2, 2
    assert att.linear_qkv.weight.shape == ((4 * 2 + 2 * 2) * d, 32)
    x = torch.randn(16, 2, 32)
    rows = att.linear_qkv.weight.view(g, 2 * qpg + 2, d, 32)  # per group: 2 queries, 2 gates, key, value
    wq, wg = rows[:, :qpg].reshape(-1, 32), rows[:, qpg:2 * qpg].reshape(-1, 32)
    wk, wv = rows[:, -2].reshape(-1, 32), rows[:, -1].reshape(-1, 32)

    def heads(w, n):
        return (x @ w.t()).view(16, 2, n, d).permute(1, 2, 0, 3)

    q, k, v = heads(wq, 4), heads(wk, 2).repeat_interleave(2, 1), heads(wv, 2).repeat_interleave(2, 1)
    core = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(16, 2, 4 * d)
    ref = (core * torch.sigmoid(x @ wg.t())) @ att.linear_proj.weight.t()
    torch.testing.assert_close(att(x, ForwardContext()), ref, rtol=1e-5, atol=1e-6)


# ---- parameter groups: weight decay and decoupled LR --------------------------------------------
def test_megatron_weight_decay_and_decoupled_rules():
    op = run_cfg(decoupled_lr=1e-3).optim
    assert not role_of("decoder.layers.0.mlp.linear_fc1.bias", 1, op).decay
    assert not role_of("decoder.layers.0.mlp.experts.linear_fc1.bias", 2, op).decay  # 2-D expert bias
    assert not role_of("decoder.layers.0.self_attention.q_layernorm.weight", 1, op).decay
    assert role_of("decoder.layers.0.mlp.linear_fc1.weight", 2, op).decay
    assert role_of("module.embedding.word_embeddings.weight", 2, op).decoupled
    assert role_of("output_layer.weight", 2, op).decoupled
    assert not role_of("embedding.position_embeddings.weight", 2, op).decoupled  # as Megatron: word table only
    qk = run_cfg(apply_wd_to_qk_layernorm=True).optim
    assert role_of("decoder.layers.0.self_attention.k_layernorm.bias", 1, qk).decay
    assert not role_of("decoder.layers.0.input_layernorm.weight", 1, qk).decay


def test_decoupled_lr_follows_the_schedule_shape():
    s = LRScheduler(1.0, 0.1, 10, 110, "cosine", decoupled_max_lr=4.0, decoupled_min_lr=0.2)
    s.step(5)
    assert (s.lr, s.decoupled_lr) == pytest.approx((0.5, 2.0))  # warm-up from 0 to each peak
    s.step(55)  # halfway through the decay: the middle of each range
    assert (s.lr, s.decoupled_lr) == pytest.approx((0.55, 2.1))
    s.step(100)
    assert (s.lr, s.decoupled_lr) == pytest.approx((0.1, 0.2))
    assert LRScheduler(1.0, 0.1, 0, 10, "linear", decoupled_max_lr=3.0).lr_at(10, 3.0, 0.1) == pytest.approx(0.1)


def test_optimizer_gives_the_embedding_and_output_layer_their_lr():
    cfg = run_cfg(decoupled_lr=5e-3, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg.model, 64)
    names = {p: n for n, p in model.named_parameters()}
    opt = Optimizer(list(model.parameters()), cfg, ParallelDims(), names)
    opt.set_lr(1e-2, 5e-3)
    lr_of = {id(m): g["lr"] for g in opt.adam.param_groups for m in g["params"]}
    for p, m in zip(opt.params, opt.masters):
        want = 5e-3 if names[p] in ("embedding.word_embeddings.weight", "output_layer.weight") else 1e-2
        assert lr_of[id(m)] == want, names[p]


# ---- Muon -----------------------------------------------------------------------------------------
def _ns_by_hand(x: torch.Tensor, steps: int, kind: str) -> torch.Tensor:
    """Newton-Schulz written out in float64: X <- aX + b(XX^T)X + c(XX^T)^2 X on the wide orientation."""
    t = x.shape[0] > x.shape[1]
    X = (x.T if t else x).double()
    X = X / X.norm()
    for a, b, c in coefficients(kind, steps):
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return (X.T if t else X).float()


@pytest.mark.parametrize("kind", ["quintic", "polar_express", "cubic5"])
def test_newton_schulz_by_hand(kind):
    x = torch.randn(24, 8)
    with fp32_matmul_precision("highest"):
        got = newton_schulz(x, 5, kind)
    torch.testing.assert_close(got, _ns_by_hand(x, 5, kind), rtol=1e-4, atol=1e-5)
    assert coefficients("quintic", 7)[5:] == coefficients("quintic", 2)  # cycles
    assert coefficients("cans", 7)[5:] == [coefficients("cans", 5)[-1]] * 2  # repeats the last


def test_muon_orthogonalises_close_to_the_polar_factor():
    x = torch.randn(32, 16)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    with fp32_matmul_precision("highest"):
        o = newton_schulz(x, 5, "quintic")
    s = torch.linalg.svdvals(o)
    assert 0.6 < s.min() and s.max() < 1.25  # quintic: singular values near 1, not exactly 1 (US'V^T)
    assert (o - u @ vh).norm() / (u @ vh).norm() < 0.35


def test_muon_step_by_hand_with_qkv_split():
    cfg = run_cfg(optimizer="muon", muon_fp32_matmul_prec="highest", muon_momentum=0.5, muon_nesterov=True,
                  muon_extra_scale_factor=0.2, weight_decay=0.1, group_query_attention=True, num_query_groups=2,
                  hidden_size=32, num_attention_heads=4)
    m = cfg.model
    w = torch.randn(sum(qkv_rows(m)) * 2, 32)
    p = torch.nn.Parameter(w.clone())
    muon = Muon([Item(p.data, p, "decoder.layers.0.self_attention.linear_qkv.weight")], cfg.optim, ParallelDims(),
                qkv_rows(m))
    muon.lr = 0.01
    g = torch.randn_like(w)
    muon.step([g.clone()])
    buf = 0.5 * g  # momentum from zero: M = 0.5 * 0 + 0.5 * g; nesterov U = 0.5 g + 0.5 M
    u = 0.5 * g + 0.5 * buf
    parts = u.view(2, -1, 32).split(qkv_rows(m), dim=1)  # queries, keys, values of both groups
    orth = [(_ns_by_hand(t.reshape(-1, 32), 5, "quintic") * math.sqrt(max(t.shape[0] * 2, 32)) * 0.2).view(2, -1, 32)
            for t in parts]
    want = w * (1 - 0.01 * 0.1) - 0.01 * torch.cat(orth, dim=1).view_as(w)
    torch.testing.assert_close(p.data, want, rtol=1e-4, atol=1e-6)


def test_muon_scale_modes():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(64, 16, "unit_rms_norm") == 2.0
    assert scale_factor(16, 64, "shape_scaling") == 1.0


def test_muon_steps_hidden_matrices_and_adam_the_rest():
    cfg = run_cfg(optimizer="muon", num_experts=2)
    model = GPTModel(cfg.model, 64)
    names = {p: n for n, p in model.named_parameters()}
    opt = Optimizer(list(model.parameters()), cfg, ParallelDims(), names)
    muon = {it.name for it in opt.muon.items}
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight" in muon and "decoder.layers.0.mlp.router.weight" in muon
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in muon
    assert "embedding.position_embeddings.weight" in muon  # as Megatron: only the word table is excluded
    assert not any("word_embeddings" in n or "layernorm" in n or n.endswith("bias") for n in muon)


# ---- flags and errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags,message", [
    (dict(swiglu=True, squared_relu=True), "--swiglu and --squared-relu exclude each other"),
    (dict(glu_linear_offset=1.0), "--glu-linear-offset needs a gated MLP"),
    (dict(swiglu=True, glu_linear_offset=1.0), "Megatron's fused SwiGLU has no offset"),
    (dict(quick_geglu=True, activation_func_clamp_value=-1.0), "--activation-func-clamp-value must be > 0"),
    (dict(quick_geglu=True, activation_func_clamp_value=float("inf")), "must be finite and > 0"),
    (dict(swiglu=True, activation_func_clamp_value=7.0), "needs --num-experts"),
    (dict(decoupled_min_lr=1e-5), "--decoupled-min-lr needs --decoupled-lr"),
    (dict(muon_momentum=0.95), "--muon-momentum has no effect without --optimizer muon"),
    (dict(optimizer="muon", fp16=True), "--optimizer muon with --fp16 is not supported"),
    (dict(optimizer="muon", muon_tp_mode="sharded"), "--muon-tp-mode sharded: choose one of"),
    (dict(optimizer="sgd"), "--optimizer sgd is not in paratron yet"),
    (dict(disable_bf16_reduced_precision_matmul=True), "needs --bf16"),
])
def test_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        run_cfg(**flags)
    assert "\n" not in str(e.value)


def test_dist_muon_is_muon_with_the_distributed_optimizer():
    cfg = run_cfg(optimizer="dist_muon")
    assert (cfg.optim.optimizer, cfg.parallel.use_distributed_optimizer) == ("muon", True)


def test_disable_bf16_reduced_precision_matmul_sets_torch():
    from paratron.train.runtime import apply_bf16_matmul_reduction
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        apply_bf16_matmul_reduction(run_cfg(bf16=True, disable_bf16_reduced_precision_matmul=True))
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_hf_conversion_refuses_the_variants():
    from paratron.checkpoint.hf_config import ConversionError, check_representable
    with pytest.raises(ConversionError, match="apply-layernorm-1p"):
        check_representable(model_cfg(apply_layernorm_1p=True, normalization="RMSNorm", swiglu=True,
                                      position_embedding_type="rope", disable_bias_linear=True), "llama")


def test_megatron_spellings_parse():
    from paratron.config import parse_args
    cfg = parse_args(["--mock-data", "--train-iters", "2", "--lr", "1e-3", "--optimizer", "muon", "--muon-no-split-qkv",
                      "--muon-use-syrk", "--no-use-layer-wise-param-layout", "--use-distributed-optimizer"])
    assert cfg.optim.muon_split_qkv is False and cfg.optim.muon_use_syrk is True
