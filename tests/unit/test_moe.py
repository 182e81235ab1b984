"""Mixture of experts at EP 1: the router, the load-balancing losses, capacity, the expert bias and
the layer against hand computations and a naive per-token reference; training, resume and FLOPs."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from paratron.config import ConfigError, ModelConfig, parse_args
from paratron.model import moe
from paratron.model.gpt import GPTModel
from paratron.model.layers import Parallel
from paratron.train.loop import Trainer
from paratron.train.metrics import flops_per_iteration

T = torch.tensor


def small(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=8, hidden_dropout=0.0, attention_dropout=0.0, moe_router_dtype="fp32")
    values = {**base, **kw}
    if values["num_experts"] is None:  # a dense model: no MoE flags
        values = {k: v for k, v in values.items() if not k.startswith("moe_")}
    return ModelConfig(**values).resolved()


# ---- router ---------------------------------------------------------------------------------------

def test_topk_softmax_after_topk():
    probs, rmap = moe.topk_route(T([[1.0, 2.0, 3.0, 0.0]]), 2)
    e = math.e
    assert rmap.tolist() == [[False, True, True, False]]
    assert torch.allclose(probs, T([[0.0, 1 / (1 + e), e / (1 + e), 0.0]]))


def test_topk_pre_softmax_and_scaling():
    logits = T([[1.0, 2.0, 3.0, 0.0]])
    full = torch.exp(logits) / torch.exp(logits).sum()
    probs, rmap = moe.topk_route(logits, 2, pre_softmax=True, scaling_factor=2.5)
    want = torch.where(rmap, full * 2.5, torch.zeros(()))
    assert rmap.tolist() == [[False, True, True, False]] and torch.allclose(probs, want)


def test_topk_sigmoid_normalised_over_topk():
    logits = T([[0.5, -1.0, 2.0]])
    s = torch.sigmoid(logits)[0]
    probs, rmap = moe.topk_route(logits, 2, score_function="sigmoid")
    assert rmap.tolist() == [[True, False, True]]
    assert torch.allclose(probs[0], T([s[0] / (s[0] + s[2]), 0.0, s[2] / (s[0] + s[2])]))
    one, _ = moe.topk_route(logits, 1, score_function="sigmoid")  # top-1: the raw sigmoid score
    assert torch.allclose(one[0], T([0.0, 0.0, s[2]]))


def test_expert_bias_chooses_but_does_not_weigh():
    logits = T([[0.5, -1.0, 2.0]])
    s = torch.sigmoid(logits)[0]
    probs, rmap = moe.topk_route(logits, 2, score_function="sigmoid", expert_bias=T([0.0, 5.0, 0.0]))
    assert rmap.tolist() == [[False, True, True]]
    assert torch.allclose(probs[0], T([0.0, s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2])]))


# ---- load-balancing losses ------------------------------------------------------------------------

def test_switch_aux_loss_by_hand():
    scores = T([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    rmap = T([[1, 1, 0], [0, 1, 1]]).bool()
    f = T([1, 2, 1]) / (2 * 2)  # share of the 4 assignments
    p = scores.mean(dim=0)
    assert torch.allclose(moe.switch_aux_loss(scores, rmap, 2), 3 * (f * p).sum())
    uniform = torch.full((4, 4), 0.25)  # perfectly balanced: 1
    assert torch.allclose(moe.switch_aux_loss(uniform, torch.eye(4).bool(), 1), T(1.0))


def test_seq_aux_loss_is_the_mean_of_per_sequence_losses():
    g = torch.Generator().manual_seed(0)
    s, b, e, k = 5, 3, 4, 2
    scores = torch.softmax(torch.randn(s * b, e, generator=g), -1)
    rmap = torch.zeros(s * b, e, dtype=torch.bool).scatter(1, torch.topk(scores, k).indices, True)
    per_seq = [moe.switch_aux_loss(scores.view(s, b, e)[:, i], rmap.view(s, b, e)[:, i], k) for i in range(b)]
    assert torch.allclose(moe.seq_aux_loss(scores, rmap, k, s), torch.stack(per_seq).mean())


def test_z_loss_by_hand():
    logits = T([[0.0, 0.0], [1.0, 2.0]])
    want = (math.log(2) ** 2 + math.log(math.e + math.e ** 2) ** 2) / 2
    assert abs(moe.z_loss(logits).item() - want) < 1e-6


def test_aux_losses_reach_the_router_without_changing_the_output():
    """The autograd trick: the layer's output is the same, the router's gradient is that of
    output + coeff * aux + zcoeff * z."""
    cfg = small(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    torch.manual_seed(0)
    layer = moe.MoELayer(cfg, Parallel())
    plain = moe.MoELayer(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), Parallel())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(8, 2, 16)
    g = torch.randn(8, 2, 16)
    moe.set_aux_loss_scale([layer.router], 1.0)
    out = layer(x)
    (out * g).sum().backward()
    ref = plain(x)
    assert torch.equal(out, ref)
    logits = x.reshape(-1, 16) @ plain.router.weight.t()
    scores, amap = moe.aux_loss_scores(logits, 2)
    total = (ref * g).sum() + 0.1 * moe.switch_aux_loss(scores, amap, 2) + 0.01 * moe.z_loss(logits)
    total.backward()
    assert torch.allclose(layer.router.weight.grad, plain.router.weight.grad, atol=1e-6)
    assert not torch.allclose(layer.router.weight.grad, torch.autograd.grad((plain(x) * g).sum(),
                                                                            plain.router.weight)[0], atol=1e-6)
    assert set(layer.router.metrics) == {"load_balancing_loss", "z_loss"}


def test_input_jitter_perturbs_the_routing_only_while_training():
    """--moe-input-jitter-eps (Megatron's; Switch Transformer): while training the router sees its input
    times U(1 - eps, 1 + eps) noise (the experts the plain input); in evaluation no noise; under
    activation checkpointing the recomputation draws the same noise (the same gradients)."""
    from paratron.parallel.random import checkpoint
    cfg = small(moe_input_jitter_eps=0.3)
    torch.manual_seed(0)
    layer = moe.MoELayer(cfg, Parallel())
    plain = moe.MoELayer(dataclasses.replace(cfg, moe_input_jitter_eps=None), Parallel())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(8, 2, 16)
    layer.eval(), plain.eval()
    assert torch.equal(layer(x), plain(x))
    layer.train(), plain.train()
    torch.manual_seed(1)
    seen = layer.router(x.reshape(-1, 16), 8)[1]
    assert not torch.equal(seen, plain.router(x.reshape(-1, 16), 8)[1])  # other experts chosen somewhere
    grads = []
    for recompute in (False, True):
        layer.zero_grad()
        torch.manual_seed(2)
        xr = x.clone().requires_grad_()
        out = checkpoint(layer, xr) if recompute else layer(xr)
        out.square().sum().backward()
        grads.append([xr.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(ConfigError, match=r"--moe-input-jitter-eps must be in \[0, 1\) \(got 1.5\)"):
        parse_args(["--config", "moe-mini", "--mock-data", "--train-iters", "1", "--moe-input-jitter-eps", "1.5"])


# ---- capacity, expert bias ------------------------------------------------------------------------

def test_capacity_drops_by_probs_or_position():
    probs = T([[0.3, 0.0], [0.9, 0.0], [0.0, 0.8], [0.5, 0.0]])
    rmap = probs > 0
    assert moe.expert_capacity(4, 1, 2, 1.0) == 2
    kept, m = moe.apply_capacity(probs, rmap, 2, "probs")  # expert 0 keeps tokens 1 and 3
    assert torch.equal(kept, T([[0.0, 0.0], [0.9, 0.0], [0.0, 0.8], [0.5, 0.0]])) and torch.equal(m, kept > 0)
    kept, m = moe.apply_capacity(probs, rmap, 2, "position")  # expert 0 keeps tokens 0 and 1
    assert torch.equal(kept, T([[0.3, 0.0], [0.9, 0.0], [0.0, 0.8], [0.0, 0.0]])) and torch.equal(m, kept > 0)
    kept, m = moe.apply_capacity(probs, rmap, 2, "position", pad=True)  # expert 1 padded with token 0
    assert m.sum(dim=0).tolist() == [2, 2] and m[0, 1] and kept[0, 1] == 0


def test_expert_bias_update_by_hand():
    bias = moe.expert_bias_update(torch.zeros(4), T([3.0, 1.0, 2.0, 2.0]), 0.01)
    assert torch.allclose(bias, T([-0.01, 0.01, 0.0, 0.0]))
    r = moe.Router(small(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                         moe_router_bias_update_rate=0.5))
    r.train()
    with torch.enable_grad():
        _, rmap = r(torch.randn(6, 16), 6)
    counts = rmap.sum(0).float()
    assert torch.equal(r.tokens_per_expert, counts)
    r.update_expert_bias()
    assert torch.equal(r.expert_bias, torch.sign(counts.mean() - counts) * 0.5)
    assert r.tokens_per_expert.sum() == 0
    assert "expert_bias" in r.state_dict() and "tokens_per_expert" not in r.state_dict()


# ---- the layer against a naive reference ----------------------------------------------------------

def naive(layer: moe.MoELayer, x: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """Token by token, expert by expert."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.t()
    probs, rmap = moe.topk_route(logits, layer.router.topk)
    e, down, up = layer.experts, layer.fc1_latent_proj, layer.fc2_latent_proj
    rows = []
    for t in range(tokens.shape[0]):
        token = tokens[t] if down is None else down.weight @ tokens[t] + down.bias  # latent MoE: routed on x
        acc = torch.zeros_like(token)
        for i in rmap[t].nonzero().flatten().tolist():
            h = e.linear_fc1.weight[i] @ token + e.linear_fc1.bias[i]
            h = F.silu(h[: h.numel() // 2]) * h[h.numel() // 2:] if swiglu else F.gelu(h)
            acc = acc + probs[t, i] * (e.linear_fc2.weight[i] @ h + e.linear_fc2.bias[i])
        rows.append(acc if up is None else up.weight @ acc + up.bias)
    out = torch.stack(rows).view_as(x)
    return out + layer.shared_experts(x) if layer.shared_experts is not None else out


@pytest.mark.parametrize("swiglu,shared,latent", [(True, None, None), (False, 12, None), (True, 12, 6)])
def test_layer_equals_naive_reference(swiglu, shared, latent):
    torch.manual_seed(1)
    cfg = small(swiglu=swiglu, moe_shared_expert_intermediate_size=shared, moe_router_load_balancing_type="none",
                moe_latent_size=latent)
    layer = moe.MoELayer(cfg, Parallel())
    if latent:  # the experts' width is the latent one; biases of the projections nonzero to be seen
        assert layer.experts.linear_fc1.weight.shape == (4, 16, latent)
        for p in (layer.fc1_latent_proj.bias, layer.fc2_latent_proj.bias):
            torch.nn.init.normal_(p.data)
    x = torch.randn(8, 2, 16, requires_grad=True)
    g = torch.randn(8, 2, 16)
    out = layer(x)
    grads = torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])
    ref = naive(layer, x, swiglu)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *layer.parameters()])
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_mm_path_equals_loop():
    torch.manual_seed(2)
    layers = [moe.MoELayer(small(swiglu=True, moe_grouped_gemm=g), Parallel()) for g in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(8, 2, 16)
    g = torch.randn(8, 2, 16)
    outs = [layer(x) for layer in layers]
    grads = [torch.autograd.grad((o * g).sum(), list(m.parameters())) for o, m in zip(outs, layers)]
    assert [m.experts.used_grouped_mm for m in layers] == [False, True]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_per_expert_loop_backward_writes_the_weight_gradient_once_not_once_per_expert():
    """Without --moe-grouped-gemm each expert's rows take their own matmul; the experts' weights are one stacked
    tensor, so a w[i] per expert would make each expert's backward write a whole [experts, out, in] gradient (64
    experts: 64 such tensors a layer). Counted: the bytes the backward's operations (not views) write, against the
    weights'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Written(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            if not func.is_view:
                self.total += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    torch.manual_seed(0)
    layer = moe.MoELayer(small(num_experts=16, moe_ffn_hidden_size=64, hidden_size=64, num_attention_heads=4,
                               disable_bias_linear=True), Parallel())
    y = layer(torch.randn(8, 2, 64))
    assert layer.experts.used_grouped_mm is False
    weights = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    with Written() as w:
        y.square().sum().backward()
    assert w.total < 4 * weights, (w.total, weights)  # (w[i] per expert: about 2 x 16 x the weights)


def test_moe_model_names_and_layer_freq():
    m = GPTModel(small(moe_layer_freq="[0,1]", swiglu=True, disable_bias_linear=True,
                       moe_shared_expert_intermediate_size=8, moe_router_enable_expert_bias=True), 64)
    names = [n for n in m.state_dict() if ".mlp." in n]
    assert names == ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                     "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.router.expert_bias",
                     "decoder.layers.1.mlp.experts.linear_fc1.weight", "decoder.layers.1.mlp.experts.linear_fc2.weight",
                     "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                     "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"]
    w = m.decoder.layers[1].mlp.experts.linear_fc1.weight
    assert w.shape == (4, 16, 16) and w._shard_spec.grad_group == "edp" and w._shard_spec.splits[0].group == "ep"


def test_latent_moe_names_flops_and_hf_refusal():
    m = GPTModel(small(moe_latent_size=4, swiglu=True, disable_bias_linear=True), 64)
    names = [n for n in m.state_dict() if "layers.0.mlp." in n]
    assert names == ["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.linear_fc1.weight",
                     "decoder.layers.0.mlp.experts.linear_fc2.weight", "decoder.layers.0.mlp.fc1_latent_proj.weight",
                     "decoder.layers.0.mlp.fc2_latent_proj.weight"]
    plain, latent = small(moe_ffn_hidden_size=8), small(moe_ffn_hidden_size=8, moe_latent_size=4)
    # per MoE layer and token: the experts' 6 e h f k shrink to latent 4 of hidden 16, plus 12 h r projections
    tokens, e, k = 2 * 8, 2, 2
    diff = flops_per_iteration(plain, 64, 2, 8) - flops_per_iteration(latent, 64, 2, 8)
    assert diff == 2 * tokens * (6 * e * k * 8 * (16 - 4) - 12 * 16 * 4)
    from paratron.checkpoint.hf_config import ConversionError, check_representable
    with pytest.raises(ConversionError, match="--moe-latent-size"):
        check_representable(small(moe_latent_size=4, swiglu=True), "mixtral")


def test_flops_count_active_experts():
    dense = small(num_experts=None, ffn_hidden_size=16)
    one = small(moe_ffn_hidden_size=8, moe_router_topk=2, ffn_hidden_size=16)  # top-2 of 8 wide = one dense MLP
    assert flops_per_iteration(one, 64, 2, 8) == flops_per_iteration(dense, 64, 2, 8)
    half = small(moe_layer_freq="[1,0]", moe_router_topk=1, ffn_hidden_size=16)
    assert flops_per_iteration(half, 64, 2, 8) < flops_per_iteration(dense, 64, 2, 8)


# ---- configuration --------------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--num-experts", "4"]


@pytest.mark.parametrize("flags,match", [
    (["--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be > 0"),
    (["--num-experts", "0"], "--num-experts must be >= 1"),
    (["--moe-layer-freq", "[1,0,1]"], "--moe-layer-freq has 3 entries, --num-layers is 2"),
    (["--moe-router-load-balancing-type", "global_aux_loss"], "--moe-router-load-balancing-type global_aux_loss: "),
    (["--moe-router-score-function", "relu"], "--moe-router-score-function relu: choose one"),
    (["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--expert-model-parallel-size", "3"], "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
    (["--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 does "
                                            "not divide the 1 ranks of a pipeline stage"),
    (["--expert-tensor-parallel-size", "3"], "--moe-ffn-hidden-size 64 is not divisible by "
                                             "--expert-tensor-parallel-size 3"),
])
def test_config_errors_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_args(BASE + flags, world_size=2 if "2" in flags else 1)
    assert "\n" not in str(e.value)


def test_moe_flags_without_experts_are_refused():
    with pytest.raises(ConfigError, match="--moe-router-topk has no effect without --num-experts"):
        parse_args(BASE[:-2] + ["--moe-router-topk", "4"])


def test_config_defaults():
    cfg = parse_args(BASE + ["--ffn-hidden-size", "24", "--moe-token-dispatcher-type", "allgather"])
    m = cfg.model
    assert (m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff,
            m.moe_expert_capacity_factor) == (24, 2, "aux_loss", 0.0, None)
    with pytest.raises(ConfigError, match="--moe-shared-expert-overlap computes the shared expert under the alltoall"):
        parse_args(BASE + ["--moe-token-dispatcher-type", "allgather", "--moe-shared-expert-overlap"])


# ---- training -------------------------------------------------------------------------------------

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--lr", "3e-3",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--seed", "5",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2", "--swiglu"]


def test_resume_is_bit_exact_with_expert_bias(tmp_path):
    def losses(trainer, steps):
        out = []
        for _ in range(steps):
            report, _, _ = trainer.train_step()
            out.append((report[0] / report[1]).item())
        return out

    flags = TINY + ["--train-iters", "4", "--hidden-dropout", "0.1"]
    straight = Trainer(parse_args(flags))
    ref = losses(straight, 4)
    first = Trainer(parse_args(flags + ["--save", str(tmp_path / "ck")]))
    got = losses(first, 2)
    first.save()
    second = Trainer(parse_args(flags + ["--load", str(tmp_path / "ck")]))
    bias = [r.expert_bias for r in moe.routers(second.models)]
    assert all(b.abs().sum() > 0 for b in bias)  # the saved (updated) bias was loaded
    got += losses(second, 2)
    assert got == ref
    a, b = straight.model.module.state_dict(), second.model.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_seed_mixtral_flags_train_through_pretrain_gpt(tmp_path):
    """The seed's MoE flags at EP 1 on a tiny model: the loss falls, the MoE losses are logged."""
    import re
    from tests.parallel.cli import run_script
    seed = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--swiglu", "--group-query-attention",
            "--num-query-groups", "2"]
    r = run_script(1, "pretrain_gpt.py", ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                          "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size",
                                          "4", "--global-batch-size", "8", "--train-iters", "40", "--lr", "3e-3",
                                          "--mock-data", "--vocab-size", "256", "--tokenizer-type", "NullTokenizer",
                                          "--log-interval", "5", "--eval-iters", "0", "--tensorboard-dir",
                                          str(tmp_path / "tb"), *seed])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if re.search(r"iteration\s+\d+/\s*40 \|", ln)]
    losses = [float(re.search(r"lm loss: (\S+)", ln).group(1)) for ln in lines]
    balance = [float(re.search(r"load_balancing_loss: (\S+) \|", ln).group(1)) for ln in lines]
    assert len(lines) == 8 and losses[-1] < 0.9 * losses[0], losses
    assert all(0.99 < b < 2.0 for b in balance), balance  # 1 when balanced; E at worst
    assert "z_loss" not in r.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [round(e.value, 4) for e in events.Scalars("load_balancing_loss")] == [round(b, 4) for b in balance]


def test_moe_mini_preset_shape():
    cfg = parse_args(["--config", "moe-mini"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.seq_length) == (16, 1024, 16, 8,
                                                                                                       2048)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff) == (8, 2, 3584, 1e-2)
    assert m.swiglu and m.moe_expert_capacity_factor is None and cfg.padded_vocab_size == 32768
    model = GPTModel(m, cfg.padded_vocab_size, device="meta")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 16 * 8 * 3 * 1024 * 3584  # 16 layers x 8 experts x SwiGLU's three matrices


def test_full_recompute_changes_nothing():
    """Recomputed MoE layers (the router runs again in backward): same losses, same expert bias."""
    runs = []
    for extra in ([], ["--recompute-granularity", "full", "--recompute-method", "uniform"]):
        t = Trainer(parse_args(TINY + ["--train-iters", "3"] + extra))
        losses = [t.train_step()[0] for _ in range(3)]
        runs.append(([(r[0] / r[1]).item() for r in losses], [r.expert_bias.clone() for r in moe.routers(t.models)]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_aligned_rows_for_grouped_gemm():
    counts = T([3, 0, 9, 1])
    expert = torch.repeat_interleave(torch.arange(4), counts)
    dest, ends, size = moe.aligned_rows(counts, expert)
    assert dest.tolist() == [0, 1, 2, 16, 17, 18, 19, 20, 21, 22, 23, 24, 32]  # (expert 1: 8 zero rows, no empty group)
    assert ends.tolist() == [8, 16, 32, 40] and ends.dtype == torch.int32 and size == 48  # 13 + 4 * 8, to 8s


def test_expert_order_of_dropless_routing_is_static_and_equals_nonzero():
    torch.manual_seed(5)
    _, rmap = moe.topk_route(torch.randn(37, 8), 2)
    want = rmap.t().nonzero(as_tuple=True)
    got = moe.expert_order(rmap, 37 * 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(moe.expert_order(rmap), want))  # without a known count


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_expert_path_compiles_as_one_graph():
    """--torch-compile compiles the dropless expert path on its own: one graph (no host sync, no
    break) whose forward and backward equal the eager path's."""
    torch.manual_seed(6)
    layer = moe.MoELayer(small(swiglu=True, moe_grouped_gemm=True, hidden_size=32, moe_ffn_hidden_size=16),
                         Parallel(), dtype=torch.bfloat16)
    tokens = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    probs, rmap = layer.router(tokens.detach(), 8)
    args = (layer.experts, tokens, probs, rmap, 16 * 2)
    want = moe.local_experts(*args)
    want_grad, = torch.autograd.grad(want.float().square().sum(), tokens)
    compiled = torch.compile(moe.local_experts, fullgraph=True, dynamic=False, backend="aot_eager")
    got = compiled(*args)
    got_grad, = torch.autograd.grad(got.float().square().sum(), tokens)
    assert layer.experts.used_grouped_mm and torch.equal(got, want) and torch.equal(got_grad, want_grad)
    layer.compile_experts()
    assert layer.local is not moe.local_experts  # dropless + grouped: compiled
    capped = moe.MoELayer(small(moe_grouped_gemm=True, moe_expert_capacity_factor=1.0), Parallel())
    capped.compile_experts()
    assert capped.local is moe.local_experts  # token dropping: data-dependent shapes stay eager


def test_torch_compile_traces_the_moe_layer():
    """--torch-compile traces the MoE layer with its transformer layer (tests/unit/test_moe_compile.py); an fp32
    layer on CPU (torch._grouped_mm compiles in bf16 only) takes the per-expert loop as an eager island, with the
    eager numbers."""
    torch.manual_seed(3)
    cfg = small(swiglu=True, moe_aux_loss_coeff=0.1)
    layer = moe.MoELayer(cfg, Parallel())
    x = torch.randn(8, 2, 16)
    want = layer(x)
    compiled = torch.compile(lambda t: layer(t) * 2.0, backend="eager")
    assert torch.allclose(compiled(x), want * 2.0)


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_that_drops_nothing_equals_dropless(pad):
    torch.manual_seed(4)
    dropless = moe.MoELayer(small(swiglu=True), Parallel())
    capped = moe.MoELayer(small(swiglu=True, moe_expert_capacity_factor=2.0,  # capacity = all 16 tokens
                                moe_pad_expert_input_to_capacity=pad), Parallel())
    capped.load_state_dict(dropless.state_dict())
    x = torch.randn(8, 2, 16)
    assert torch.allclose(capped(x), dropless(x), atol=1e-6)
    tight = moe.MoELayer(small(swiglu=True, moe_expert_capacity_factor=0.5), Parallel())
    tight.load_state_dict(dropless.state_dict())
    assert not torch.allclose(tight(x), dropless(x), atol=1e-6)  # capacity 4 of 8 assignments per expert


def test_bf16_moe_model_trains():
    """bf16 with token dropping: finite losses (mock tokens are uniform, so about ln 128 and no trend to
    expect) and every expert weight and the router updated by the optimizer."""
    t = Trainer(parse_args(TINY + ["--train-iters", "3", "--bf16", "--moe-expert-capacity-factor", "1.0"]))
    layer = next(m for m in t.model.module.modules() if isinstance(m, moe.MoELayer))
    before = [p.detach().float().clone() for p in (layer.router.weight, layer.experts.linear_fc1.weight,
                                                   layer.experts.linear_fc2.weight)]
    losses = [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(3))]
    after = (layer.router.weight, layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight)
    assert all(math.isfinite(v) and abs(v - math.log(128)) < 0.5 for v in losses), losses
    assert all(not torch.equal(a, b.detach().float()) for a, b in zip(before, after))
