"""Multi-token prediction (paratron/model/mtp.py): the MTP losses and the gradients they add (shared
embedding / output layer, MTP layers) against a hand-written computation with the same weights, the
flags' one-line errors, FLOPs by hand, the HF-export refusal and generation ignoring the MTP layers."""
import pytest
import torch
import torch.nn.functional as F

from paratron.config import Config, ConfigError, finalize
from paratron.config import ModelConfig
from paratron.model.gpt import GPTModel
from paratron.model.layers import ForwardContext

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2


def config(**changes) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, max_position_embeddings=SEQ,
                hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    return ModelConfig(**dict(base, **changes))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ)
    mask[0, 3], mask[1, 5:7], mask[1, -1] = 0, 0, 0  # holes, and a masked last position
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    return ids, labels, mask, pos


def shift(t):  # left by one, zero shifted in (written out, not model/mtp.roll_left)
    return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)


def reference(model: GPTModel, ids, labels, mask, pos):
    """(main per-token losses [b, s], [(masked CE sum, token count) per depth]) by hand; the decoder and
    the MTP layers' transformer layers are called as modules (tested elsewhere), the rest is written out."""
    w, p = model.embedding.word_embeddings.weight, model.embedding.position_embeddings.weight
    eps = model.config.norm_epsilon

    def embed(i, q):
        return (w[i] + p[q]).transpose(0, 1)  # [s, b, h]

    def norm(mod, x):
        return F.layer_norm(x, (HIDDEN,), mod.weight, mod.bias, eps)

    def ce(hidden, target):  # [s, b, h] -> [b, s] through the tied output layer
        logits = (hidden @ w.t()).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)

    h = model.decoder(embed(ids, pos), ForwardContext())  # after the final norm
    main, depths = ce(h, labels), []
    for layer in model.mtp.layers:
        ids, pos, labels, mask = shift(ids), shift(pos), shift(labels), shift(mask)
        x = torch.cat([norm(layer.enorm, embed(ids, pos)), norm(layer.hnorm, h)], dim=-1)
        h = norm(layer.final_layernorm, layer.mtp_model_layer(x @ layer.eh_proj.weight.t(), ForwardContext()))
        depths.append(((ce(h, labels) * mask).sum(), mask.sum()))
    return main, depths


@pytest.mark.parametrize("per_token", [False, True])
def test_mtp_loss_and_gradients_equal_hand_computation(per_token):
    torch.manual_seed(0)
    model = GPTModel(config().resolved(), VOCAB).train()
    ids, labels, mask, pos = batch()
    model.mtp.loss_scale, model.mtp.per_token_loss = 1.0, per_token
    model.fused_output_loss = not per_token  # both output-layer paths
    out = model(ids, position_ids=pos, labels=labels, loss_mask=mask)
    main_sum, n = (out * mask).sum(), mask.sum()
    (main_sum if per_token else main_sum / n).backward()

    main, depths = reference(model, ids, labels, mask, pos)
    assert torch.allclose(out, main, atol=1e-5)
    logged = model.mtp.metrics
    assert torch.allclose(logged[:, 0], torch.stack([s / c for s, c in depths]), atol=1e-5)
    assert logged[:, 1].tolist() == [1.0, 1.0]
    assert n.item() == 20 and [c.item() for _, c in depths] == [18, 16]  # each shift drops two positions
    if per_token:  # sums, each depth re-weighted to the main loss's token count
        mtp = 0.3 / 2 * sum(s * n / c for s, c in depths)
        ref_main = (main * mask).sum()
    else:
        mtp = 0.3 / 2 * sum(s / c for s, c in depths)
        ref_main = (main * mask).sum() / n
    params = [model.embedding.word_embeddings.weight, model.mtp.layers[0].eh_proj.weight,
              model.mtp.layers[1].mtp_model_layer.mlp.linear_fc1.weight, model.decoder.layers[0].mlp.linear_fc1.weight]
    expected = torch.autograd.grad(ref_main + mtp, params, retain_graph=True)
    for param, g in zip(params, expected):
        assert torch.allclose(param.grad, g, rtol=1e-4, atol=1e-7)
    # The MTP loss changes the shared embedding / output layer's gradient, by its own gradient.
    main_only = torch.autograd.grad(ref_main, params[0], retain_graph=True)[0]
    mtp_part = torch.autograd.grad(mtp, params[0])[0]
    assert mtp_part.norm() > 1e-3 * main_only.norm()
    assert torch.allclose(params[0].grad - main_only, mtp_part, rtol=1e-4, atol=1e-7)


def test_repeated_layer_is_layer_0_at_every_depth():
    """--mtp-use-repeated-layer: one MTP layer; the losses and gradients of a model whose N layers all hold
    its weights (their gradients summed onto it)."""
    torch.manual_seed(0)
    one = GPTModel(config(mtp_num_layers=3, mtp_use_repeated_layer=True).resolved(), VOCAB).train()
    three = GPTModel(config(mtp_num_layers=3).resolved(), VOCAB).train()
    assert [n for n in one.state_dict() if n.startswith("mtp.")] == \
        [n for n in three.state_dict() if n.startswith("mtp.layers.0.")]
    state = {n: v for n, v in one.state_dict().items() if not n.startswith("mtp.")}
    for k in range(3):
        state.update({n.replace("layers.0.", f"layers.{k}.", 1): v for n, v in one.state_dict().items()
                      if n.startswith("mtp.")})
    three.load_state_dict(state)
    ids, labels, mask, pos = batch()
    for m in (one, three):
        m.mtp.loss_scale = 1.0
        (m(ids, position_ids=pos, labels=labels, loss_mask=mask) * mask).sum().backward()
    assert one.mtp.metrics.shape == (3, 2) and torch.allclose(one.mtp.metrics, three.mtp.metrics, atol=1e-6)
    for n, p in one.mtp.layers[0].named_parameters():
        summed = sum(dict(three.mtp.layers[k].named_parameters())[n].grad for k in range(3))
        assert torch.allclose(p.grad, summed, atol=1e-6), n
    moe = GPTModel(config(mtp_num_layers=4, mtp_use_repeated_layer=True, num_experts=2, moe_router_topk=1,
                          moe_aux_loss_coeff=0.02, moe_z_loss_coeff=1e-3).resolved(), VOCAB)
    router = moe.mtp.layers[0].mtp_model_layer.mlp.router
    assert router.cfg.moe_aux_loss_coeff == pytest.approx(0.005) and router.cfg.moe_z_loss_coeff == pytest.approx(2.5e-4)
    assert moe.decoder.layers[0].mlp.router.cfg.moe_aux_loss_coeff == 0.02  # the decoder's own: unchanged


def test_detached_heads_train_only_the_mtp_layers():
    """--mtp-detach-heads: the decoder, embedding and output layer get the main loss's gradients only;
    the MTP layers get theirs, the same as without detaching."""
    torch.manual_seed(0)
    grads = {}
    for detach in (False, True):
        model = GPTModel(config(mtp_detach_heads=detach).resolved(), VOCAB).train()
        ids, labels, mask, pos = batch()
        model.mtp.loss_scale = 1.0
        (model(ids, position_ids=pos, labels=labels, loss_mask=mask) * mask).sum().backward()
        grads[detach] = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain = GPTModel(config(mtp_num_layers=None, mtp_loss_scaling_factor=0.1).resolved(),
                     VOCAB).train()  # the same seed
    ids, labels, mask, pos = batch()
    (plain(ids, position_ids=pos, labels=labels) * mask).sum().backward()
    for n, p in plain.named_parameters():  # the main loss's gradients alone
        assert torch.allclose(grads[True][n], p.grad, atol=1e-6), n
        assert not torch.allclose(grads[False][n], p.grad, atol=1e-6) or "position" in n, n
    mtp_names = [n for n in grads[True] if n.startswith("mtp.layers.1.")]  # the last depth sees only its own loss
    for n in mtp_names:
        assert torch.allclose(grads[True][n], grads[False][n], atol=1e-6), n


@pytest.mark.parametrize("distributed", [False, True])
def test_detached_heads_are_clipped_by_their_own_norm(distributed):
    """The gradients that reach Adam: the model's times clip / (its norm), the MTP layers' times clip / (theirs)."""
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters", "2", "--lr", "1e-3",
             "--num-workers", "0", "--eval-iters", "0", "--mtp-num-layers", "1", "--mtp-detach-heads",
             "--clip-grad", "1e-3"] + (["--use-distributed-optimizer"] if distributed else [])
    t = Trainer(parse_args(flags))
    opt, raw, clipped = t.optimizer, [], []
    real_grads, real_step = opt._grads, opt.adam.step

    def grads_before_clipping():
        g = real_grads()
        raw.extend(x.clone() for x in g)
        return g

    def adam_step(*args, **kwargs):
        clipped.extend(m.grad.clone() for m in opt.masters)
        return real_step(*args, **kwargs)
    opt._grads, opt.adam.step = grads_before_clipping, adam_step
    t.train_step()
    own = opt._own
    assert any(own) and not all(own)
    norms = {o: torch.stack([r.square().sum() for r, w in zip(raw, own) if w == o]).sum().sqrt() for o in (False, True)}
    assert norms[False] > 1e-2 and norms[True] > 1e-2  # both clipped, by different factors
    for r, c, o in zip(raw, clipped, own):
        assert torch.allclose(c, r * (1e-3 / (norms[o] + 1e-6)), rtol=1e-5, atol=1e-12)


def test_full_recomputation_gives_the_same_gradients():
    ids, labels, mask, pos = batch()
    grads = []
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = GPTModel(config(hidden_dropout=0.1).resolved(), VOCAB, recompute_granularity=recompute).train()
        torch.manual_seed(1)  # the same dropout masks in both runs
        out = model(ids, position_ids=pos, labels=labels, loss_mask=mask)
        ((out * mask).sum() / mask.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")})
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n


def test_generation_and_evaluation_ignore_mtp():
    """In eval mode (and without labels) the MTP layers do not run: the outputs are those of the model
    without MTP holding the same other weights, and nothing is logged."""
    torch.manual_seed(0)
    model = GPTModel(config().resolved(), VOCAB).eval()
    plain = GPTModel(config(mtp_num_layers=None, mtp_loss_scaling_factor=0.1).resolved(), VOCAB).eval()
    missing = plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    assert not missing.missing_keys
    ids, labels, mask, pos = batch()
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))
        assert torch.equal(model(ids, labels=labels, loss_mask=mask), plain(ids, labels=labels))
    assert model.mtp.metrics is None


def _resolved(world=1, **fields):
    cfg = Config()
    for k, v in dict(num_layers=2, attention_dropout=0.0, **fields).items():
        cfg.set(k, v)
    cfg.data.mock_data, cfg.train.train_iters, cfg.optim.lr = True, 1, 1e-3
    return finalize(cfg, world)


@pytest.mark.parametrize("fields,world,match", [
    (dict(mtp_num_layers=0), 1, "--mtp-num-layers must be >= 1"),
    (dict(mtp_num_layers=1, mtp_loss_scaling_factor=float("nan")), 1, "--mtp-loss-scaling-factor must be a finite"),
    (dict(mtp_loss_scaling_factor=0.2), 1, "--mtp-loss-scaling-factor has no effect without --mtp-num-layers"),
    (dict(mtp_use_repeated_layer=True), 1, "--mtp-use-repeated-layer has no effect without --mtp-num-layers"),
    (dict(mtp_num_layers=1, pipeline_model_parallel_size=2), 2, "--pipeline-model-parallel-size 2"),
    (dict(pipeline_model_parallel_layout="Et|tmL", pipeline_model_parallel_size=2), 2, "MTP layers"),
])
def test_flag_errors(fields, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        _resolved(world, **fields)
    assert "\n" not in str(e.value)


def test_megatron_flags_parse():
    from paratron.config.megatron_flags import refusal
    assert refusal("mtp_num_layers") is None and refusal("mtp_loss_scaling_factor") is None
    assert refusal("mtp_use_repeated_layer") is None and refusal("mtp_detach_heads") is None
    assert "multi-token prediction" in refusal("mtp_hsm")
    cfg = _resolved(mtp_num_layers=3)
    assert cfg.model.mtp_num_layers == 3 and cfg.model.mtp_loss_scaling_factor == 0.1  # Megatron's default


def test_flops_by_hand():
    """Megatron's formula: N more layers (MoE as the last layer), MTP norms and projection, N more logits."""
    from paratron.train.metrics import flops_per_iteration
    h, f, v, L, N, b, s = 32, 128, 64, 2, 2, 2, SEQ
    dense = config(mtp_num_layers=None, mtp_loss_scaling_factor=0.1).resolved()
    with_mtp = config().resolved()
    layer = 6 * h * f * 2 + 6 * (h * 3 * h + h * h)  # MLP + attention projections per token
    extra = b * s * (N * layer + 6 * N * (3 * h + 2 * h * h) + N * 6 * h * v) + b * s * s * 6 * h * N
    assert flops_per_iteration(with_mtp, v, b, s) - flops_per_iteration(dense, v, b, s) == pytest.approx(extra)
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq="[1,0]")
    moe_last = dict(moe, moe_layer_freq="[0,1]")
    diff = (flops_per_iteration(config(**moe_last).resolved(), v, b, s)
            - flops_per_iteration(config(**moe).resolved(), v, b, s))
    assert diff == pytest.approx(b * s * N * 6 * h * 2 * (16 * 2 - f))  # the MTP layers became MoE layers


def test_hf_export_refuses_and_checkpoint_config_compares_mtp():
    from paratron.checkpoint.compat import model_differences
    from paratron.checkpoint.hf_config import ConversionError, check_representable
    with pytest.raises(ConversionError, match="multi-token prediction"):
        check_representable(config().resolved(), "gpt2")
    saved = _resolved(mtp_num_layers=1).to_dict()
    assert model_differences(saved, _resolved(mtp_num_layers=1)) == []
    assert model_differences(saved, _resolved()) == [("mtp_num_layers", 1, None)]


def test_context_parallel_is_accepted():
    """CP shifts the tokens across its ranks (tests/parallel/test_mtp_parallel.py): no longer an error."""
    assert _resolved(2, mtp_num_layers=1, context_parallel_size=2).parallel.context_parallel_size == 2
