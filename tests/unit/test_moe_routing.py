"""The routing flags of issue 19 on one process: Sinkhorn routing (hand-computed balancing, the
training/eval choice), group-limited routing (hand-computed; the MoE layer against transformers'
DeepSeek-V3 MoE block), forced load balancing (random logits, straight-through gradient, replayed by
recomputation), the shared-expert gate (hand-computed), per-layer loss tags, and the config errors."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ConfigError, ModelConfig, parse_args
from paratron.model import moe, routing
from paratron.model.layers import Parallel

T = torch.tensor


# ---- Sinkhorn -----------------------------------------------------------------------------------

def test_sinkhorn_balances_rows_and_columns_by_hand():
    """Two tokens, two experts: exp(cost) = [[e, 1], [1, 1]]. The fixed point has row sums 1/2 and
    column sums 1/2 (tokens x row sum = experts x column sum = 1)."""
    out = routing.sinkhorn(T([[1.0, 0.0], [0.0, 0.0]]), tol=1e-9)
    torch.testing.assert_close(out.sum(dim=1), T([0.5, 0.5]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.sum(dim=0), T([0.5, 0.5]), rtol=0, atol=1e-6)
    # a doubly-stochastic scaling of [[e, 1], [1, 1]]: out = diag(a) K diag(b), so out00 out11 = e out01 out10
    assert abs(out[0, 0] * out[1, 1] - torch.e * out[0, 1] * out[1, 0]) < 1e-6
    # first sweep by hand: d0 = 1/2 / (K @ 1) = [1/(2(e+1)), 1/4]; d1 = 1/2 / (d0 @ K)
    k = T([[torch.e, 1.0], [1.0, 1.0]])
    d0 = 0.5 / k.sum(1)
    d1 = 0.5 / (d0[:, None] * k).sum(0)
    one = routing.sinkhorn(T([[1.0, 0.0], [0.0, 0.0]]), tol=10.0)  # stops after the first sweep
    torch.testing.assert_close(one, d1 * k * d0[:, None])


def test_sinkhorn_route_spreads_tokens_that_top1_piles_on_one_expert():
    """Every token prefers expert 0 a little: top-1 sends all to it; Sinkhorn (training) balances
    them; the probabilities are sigmoid(logit) of the chosen expert (top-1), as Megatron's."""
    logits = T([[0.3, 0.0], [0.2, 0.0], [0.1, 0.0], [0.4, 0.0]])
    probs, rmap = routing.sinkhorn_route(logits, 1, training=True)
    assert rmap.sum(dim=0).tolist() == [2, 2]
    assert rmap[:, 0].tolist() == [True, False, False, True]  # the two strongest preferences keep expert 0
    torch.testing.assert_close(probs, torch.sigmoid(logits) * rmap)
    probs, rmap = routing.sinkhorn_route(logits, 1, training=False)  # eval: plain top-1 of the sigmoid
    assert rmap[:, 0].all()
    probs2, rmap2 = routing.sinkhorn_route(logits, 2, training=False)  # top-2: the softmax over all experts
    torch.testing.assert_close(probs2, torch.softmax(logits, dim=-1))


def test_sinkhorn_router_has_no_aux_loss_and_the_gradient_flows():
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_experts=4, moe_router_topk=1,
                      moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3).resolved()
    torch.manual_seed(0)
    router = moe.Router(cfg)
    probs, rmap = router(torch.randn(16, 8), 16)
    assert set(router.metrics) == {"z_loss"} and rmap.sum().item() == 16
    probs.sum().backward()
    assert router.weight.grad.abs().sum() > 0


# ---- group-limited routing ----------------------------------------------------------------------

def test_group_limited_topk_by_hand():
    """8 experts in 4 groups of 2, top-4 within 2 groups: each group's score is the sum of its best
    4 // 2 = 2 experts. Groups: (0.9+0.0), (0.5+0.5), (0.8+0.3), (0.1+0.1): groups 1 and 2 are kept,
    so expert 0 (the single best) is not chosen."""
    scores = T([[0.9, 0.0, 0.5, 0.5, 0.8, 0.3, 0.1, 0.1]])
    top, index = routing.group_limited_topk(scores, 4, 4, 2)
    assert sorted(index[0].tolist()) == [2, 3, 4, 5]
    probs, rmap = routing.topk_route(torch.logit(scores.clamp(1e-4, 1 - 1e-4)), 4, "sigmoid", num_groups=4,
                                     group_topk=2)
    assert rmap[0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    torch.testing.assert_close(probs[0, 2:6], T([0.5, 0.5, 0.8, 0.3]) / 2.1)


def test_group_limited_softmax_reads_the_logits_or_the_pre_softmax_scores():
    logits = T([[3.0, -5.0, 1.0, 1.0, 2.0, 0.5, 0.0, 0.0]])
    # on the logits, the groups' top-2 sums are -2, 2, 2.5, 0: group 2 (experts 4, 5)
    _, rmap = routing.topk_route(logits, 2, "softmax", num_groups=4, group_topk=1)
    assert rmap[0].nonzero().flatten().tolist() == [4, 5]
    # on the softmax: e^3 + e^-5 = 20.1 beats e^2 + e^0.5 = 9.0 (up to the common normaliser): group 0
    probs, rmap = routing.topk_route(logits, 2, "softmax", pre_softmax=True, num_groups=4, group_topk=1)
    assert rmap[0].nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[0, :2], torch.softmax(logits, -1)[0, :2])


def _hf_deepseek_block(cfg: ModelConfig, bias: torch.Tensor):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                              n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                              n_group=cfg.moe_router_num_groups, topk_group=cfg.moe_router_group_topk,
                              routed_scaling_factor=cfg.moe_router_topk_scaling_factor, norm_topk_prob=True,
                              n_shared_experts=1, hidden_act="silu")
    block = DeepseekV3MoE(hf_cfg).float()
    block.gate.e_score_correction_bias.copy_(bias)
    return block


def test_group_limited_moe_layer_equals_transformers_deepseek_v3():
    """The MoE layer (sigmoid scores, expert bias, 16 experts in 4 groups, top-4 within 2 groups,
    scaling 2.5, a shared expert) on the weights of transformers' DeepseekV3MoE gives its outputs."""
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, num_experts=16, moe_router_topk=4,
                      moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, swiglu=True,
                      disable_bias_linear=True, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
                      moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32").resolved()
    torch.manual_seed(0)
    layer = moe.MoELayer(cfg, Parallel()).eval()
    layer.router.expert_bias.copy_(torch.randn(16) * 0.05)
    hf = _hf_deepseek_block(cfg, layer.router.expert_bias)
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.weight)
        hf.experts.gate_up_proj.copy_(layer.experts.linear_fc1.weight)
        hf.experts.down_proj.copy_(layer.experts.linear_fc2.weight)
        gate, up = layer.shared_experts.linear_fc1.weight.chunk(2)
        hf.shared_experts.gate_proj.weight.copy_(gate)
        hf.shared_experts.up_proj.weight.copy_(up)
        hf.shared_experts.down_proj.weight.copy_(layer.shared_experts.linear_fc2.weight)
    x = torch.randn(8, 3, 32)  # [sequence, batch, hidden]
    with torch.no_grad():
        ours = layer(x)
        theirs = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
        _, _, hf_index = hf.gate(x.reshape(-1, 32))
        _, rmap = layer.router(x.reshape(-1, 32), 8)
    want = torch.zeros(24, 16, dtype=torch.bool).scatter(1, hf_index, True)
    assert torch.equal(rmap, want)
    # the groups matter here: plain top-4 would choose other experts for some tokens
    _, plain = routing.topk_route(x.reshape(-1, 32) @ layer.router.weight.t(), 4, "sigmoid",
                                  expert_bias=layer.router.expert_bias)
    assert not torch.equal(plain, want)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ---- forced load balancing ----------------------------------------------------------------------

def test_force_load_balancing_draws_normal_logits_with_a_straight_through_gradient():
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_experts=4, moe_router_topk=2,
                      moe_router_force_load_balancing=True).resolved()
    from paratron.parallel.random import RNGTracker
    torch.manual_seed(0)
    tracker = RNGTracker(1234, 0, offset=1024)
    router = moe.Router(cfg, random=tracker)
    x = torch.randn(4000, 8)
    expected = RNGTracker(1234, 0, offset=1024)
    with expected.fork():
        want = torch.randn(4000, 4)
    probs, rmap = router(x, 4000)
    want_probs, want_map = routing.topk_route(want, 2)
    assert torch.equal(rmap, want_map)
    torch.testing.assert_close(probs, want_probs)
    counts = rmap.sum(dim=0).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.1  # balanced, whatever the (zero-gradient) weights
    (probs * torch.arange(4.0)).sum().backward()  # d/dlogits of the probs reaches the weight unchanged
    logits = want.clone().requires_grad_()
    p, _ = routing.topk_route(logits, 2)
    (p * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(router.weight.grad, logits.grad.t() @ x)


def test_force_load_balancing_recompute_replays_the_logits():
    """Full recomputation draws the same random logits in backward: the gradients equal the plain run's."""
    from paratron.model.gpt import GPTModel
    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, num_experts=4, moe_router_topk=2,
              moe_router_force_load_balancing=True, hidden_dropout=0.0, attention_dropout=0.0)
    grads = []
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = GPTModel(ModelConfig(**kw).resolved(), 64, recompute_granularity=recompute, recompute_method="uniform",
                         recompute_num_layers=1 if recompute else None)
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        model(tokens, labels=tokens).float().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7)


def test_force_load_balancing_resumes_its_random_stream(tmp_path):
    """The expert-parallel stream is saved with the other RNG states: 2 steps, save, load, 2 steps
    draw the random logits of 4 uninterrupted steps (the same losses, bit for bit)."""
    from paratron.train.loop import Trainer
    from tests.unit.test_moe import TINY
    flags = TINY + ["--train-iters", "4", "--moe-router-force-load-balancing"]

    def run(trainer, steps):
        return [trainer.train_step()[0][0].item() for _ in range(steps)]

    ref = run(Trainer(parse_args(flags)), 4)
    first = Trainer(parse_args(flags + ["--save", str(tmp_path / "ck")]))
    got = run(first, 2)
    first.save()
    got += run(Trainer(parse_args(flags + ["--load", str(tmp_path / "ck")])), 2)
    assert got == ref


# ---- shared-expert gate -------------------------------------------------------------------------

def test_shared_expert_gate_scales_by_the_sigmoid_of_its_gate():
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_experts=4, moe_router_topk=2,
                      moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True, swiglu=True).resolved()
    torch.manual_seed(0)
    layer = moe.MoELayer(cfg, Parallel())
    shared = layer.shared_experts
    assert dict(layer.named_parameters())["shared_experts.gate_weight"].shape == (1, 8)
    x = torch.randn(5, 2, 8)
    plain = moe.MLP.forward(shared, x)
    gate = torch.sigmoid((x * shared.gate_weight[0]).sum(-1, keepdim=True))
    torch.testing.assert_close(shared(x), plain * gate)


# ---- per-layer logging --------------------------------------------------------------------------

def test_take_metrics_gives_megatrons_per_layer_tags():
    cfg = ModelConfig(num_layers=3, hidden_size=8, num_attention_heads=2, num_experts=4, moe_router_topk=2,
                      moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                      moe_z_loss_coeff=1e-3).resolved()
    a, b = moe.Router(cfg, layer=1), moe.Router(cfg, layer=2)
    a.metric_sums.copy_(T([[0.0, 0.0], [2.0, 2.0], [6.0, 2.0]]))  # [METRICS, (sum, forward passes)]
    b.metric_sums.copy_(T([[0.0, 0.0], [5.0, 2.0], [2.0, 2.0]]))
    means, layers = moe.take_metrics([a, b], "cpu", False, 3)
    assert means == {"seq_load_balancing_loss": 1.75, "z_loss": 2.0}
    assert layers == {"moe/seq_load_balancing_loss_layer_0": 0.0, "moe/seq_load_balancing_loss_layer_1": 1.0,
                      "moe/seq_load_balancing_loss_layer_2": 2.5, "moe/z_loss_layer_0": 0.0,
                      "moe/z_loss_layer_1": 3.0, "moe/z_loss_layer_2": 1.0}
    assert a.metrics == {} and b.metrics == {}


def test_per_layer_tags_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from paratron.train.loop import Trainer
    cfg = parse_args(BASE + ["--moe-layer-freq", "[0,1]", "--moe-aux-loss-coeff", "1e-2", "--moe-per-layer-logging",
                             "--tensorboard-dir", str(tmp_path), "--log-interval", "1"])
    t = Trainer(cfg)
    t.train()
    t.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"moe/load_balancing_loss_layer_0", "moe/load_balancing_loss_layer_1"} <= set(tags)
    assert [e.value for e in events.Scalars("moe/load_balancing_loss_layer_0")] == [0.0, 0.0]  # the dense layer
    layer1 = [e.value for e in events.Scalars("moe/load_balancing_loss_layer_1")]
    assert layer1 == pytest.approx([e.value for e in events.Scalars("load_balancing_loss")])  # its only MoE layer


# ---- configuration ------------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--num-experts", "4"]


@pytest.mark.parametrize("flags,match", [
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"], "without an aux loss"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1"], "not sinkhorn"),
    (["--moe-router-group-topk", "2"], "--moe-router-group-topk 2 needs --moe-router-num-groups"),
    (["--moe-router-group-topk", "1", "--moe-router-num-groups", "3"], "--num-experts 4 is not divisible by --moe-"),
    (["--moe-router-group-topk", "4", "--moe-router-num-groups", "2"], "is more than --moe-router-num-groups 2"),
    (["--moe-router-group-topk", "2", "--moe-router-num-groups", "4", "--moe-router-topk", "3"], "a multiple of"),
    (["--moe-router-num-groups", "2"], "has no effect without --moe-router-group-topk"),
    (["--moe-flex-dispatcher-backend", "nvshmem"], "choose one of deepep, hybridep, ncclep"),
    (["--moe-flex-dispatcher-backend", "ncclep"], "ncclep needs --moe-token-dispatcher-type flex"),
    (["--moe-token-dispatcher-type", "flex"], "needs --expert-model-parallel-size x --expert-tensor-parallel-size"),
    (["--moe-shared-expert-gate"], "set --moe-shared-expert-intermediate-size"),
    (["--moe-enable-deepep"], "--moe-enable-deepep needs --moe-token-dispatcher-type flex"),
    (["--moe-enable-deepep", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"],
     "the flex dispatcher takes one backend"),
])
def test_config_errors_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_args(BASE + flags)
    assert "\n" not in str(e.value)


def test_per_layer_logging_needs_experts():
    flags = [f for f in BASE if f not in ("--num-experts", "4")]
    with pytest.raises(ConfigError, match="--moe-per-layer-logging has no effect without --num-experts"):
        parse_args(flags + ["--moe-per-layer-logging"])



def test_enable_deepep_is_the_deepep_backend_of_the_flex_dispatcher():
    """Megatron's deprecated --moe-enable-deepep: with the flex dispatcher, the deepep backend."""
    flags = BASE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"]
    cfg = parse_args(flags + ["--moe-flex-dispatcher-backend", "ncclep"], world_size=2)
    assert cfg.model.moe_enable_deepep and cfg.model.moe_flex_dispatcher_backend == "deepep"
