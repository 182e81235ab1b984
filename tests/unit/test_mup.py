"""muP (--use-mup, paratron/model/mup.py): Megatron's derived values and checks, the width-scaled
initialisation measured on a model, the attention scale and the embedding / logit multipliers against
the plain model, and the optimizer's hidden-matrix LR and epsilon through the Trainer."""
import pytest
import torch

from paratron.checkpoint.hf_config import ConversionError, check_representable
from paratron.config import ModelConfig, parse_args
from paratron.errors import ConfigError
from paratron.model.gpt import GPTModel

LLAMA = dict(num_layers=2, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
             normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
             untie_embeddings_and_output_weights=True)
FLAGS = ["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--adam-eps", "1e-8",
         "--num-workers", "0", "--eval-iters", "0", "--seed", "5"]


def model(**kw):
    return GPTModel(ModelConfig(**{"hidden_size": 64, **LLAMA, **kw}).resolved(), 256, seed=3).eval()


def test_width_multiplier_and_output_multiplier_are_derived_as_megatron():
    cfg = parse_args(FLAGS + ["--hidden-size", "128", "--use-mup", "--mup-base-hidden-size", "32"]).model
    assert cfg.mup_width_mult == 4.0 and cfg.mup_output_mult == 0.25
    kept = parse_args(FLAGS + ["--hidden-size", "128", "--use-mup", "--mup-base-hidden-size", "32",
                               "--mup-output-mult", "0.5"]).model
    assert kept.mup_output_mult == 0.5
    base = parse_args(FLAGS + ["--hidden-size", "128", "--use-mup"]).model  # no base width: m = 1
    assert base.mup_width_mult == 1.0 and base.mup_base_hidden_size == 128 and base.mup_output_mult == 1.0


@pytest.mark.parametrize("flags,needle", [
    (["--mup-embedding-mult", "2"], "--mup-embedding-mult: no effect without --use-mup"),
    (["--use-mup", "--mup-base-hidden-size", "32", "--mup-width-mult", "3"],
     "--mup-width-mult 3.0 is computed as --hidden-size / --mup-base-hidden-size = 2"),
    (["--use-mup", "--mup-base-hidden-size", "0"], "--mup-base-hidden-size"),
])
def test_mup_flag_errors(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(FLAGS + ["--hidden-size", "64", *flags])


def test_initialisation_is_width_scaled():
    """m = 4: hidden matrices at std / 2, residual projections at std / (sqrt(2 L) * 2), embeddings and the
    untied output layer unscaled (measured std within 3 %)."""
    m = model(hidden_size=256, use_mup=True, mup_base_hidden_size=64, init_method_std=0.02)
    plain = model(hidden_size=256, init_method_std=0.02)
    layer = m.decoder.layers[0]
    want = {
        layer.self_attention.linear_qkv.weight: 0.01, layer.mlp.linear_fc1.weight: 0.01,
        layer.self_attention.linear_proj.weight: 0.005, layer.mlp.linear_fc2.weight: 0.005,
        m.embedding.word_embeddings.weight: 0.02, m.output_layer.weight: 0.02,
    }
    for p, std in want.items():
        assert abs(p.detach().std().item() / std - 1) < 0.03, (tuple(p.shape), p.std().item(), std)
    assert abs(plain.output_layer.weight.std().item() / 0.02 - 1) < 0.03


def test_multipliers_and_attention_scale():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model()(ids)
        # m = 1 with the standard 1/sqrt(d) (power 0.5, or a base head dim equal to d): the plain model
        assert torch.allclose(model(use_mup=True, mup_attn_scale_power=0.5)(ids), ref, atol=1e-6)
        assert torch.allclose(model(use_mup=True, mup_base_head_dim=16)(ids), ref, atol=1e-6)
        assert not torch.allclose(model(use_mup=True)(ids), ref, atol=1e-3)  # muP's 1/d
        half = model(use_mup=True, mup_attn_scale_power=0.5, mup_output_mult=0.5)(ids)
        assert torch.allclose(half, 0.5 * ref, atol=1e-6)  # the logits times the output multiplier
        assert not torch.allclose(model(use_mup=True, mup_attn_scale_power=0.5, mup_embedding_mult=2.0)(ids), ref,
                                  atol=1e-3)


@pytest.mark.parametrize("distributed", [False, True])
def test_hidden_matrices_step_with_lr_and_eps_over_m(distributed):
    from paratron.train.loop import Trainer
    flags = FLAGS + ["--hidden-size", "128", "--use-mup", "--mup-base-hidden-size", "32", "--swiglu",
                     "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                     "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    t = Trainer(parse_args(flags + (["--use-distributed-optimizer"] if distributed else [])))
    for _ in range(2):
        t.train_step()
    names = {id(p): n for n, p in t.model.module.named_parameters()}
    if not distributed:  # masters are the fp32 parameters themselves: name each group's members
        groups = {g["hidden"]: {names[id(p)] for p in g["params"] if id(p) in names}
                  for g in t.optimizer.adam.param_groups}
        assert any("linear_qkv.weight" in n for n in groups[True]) and any("linear_fc2.weight" in n for n in groups[True])
        assert not any("embedding" in n or "output_layer" in n or "norm" in n for n in groups[True])
    lr = t.scheduler.lr
    assert lr > 0 and t.scheduler.hidden_lr == pytest.approx(lr / 4)
    for g in t.optimizer.adam.param_groups:
        assert g["eps"] == pytest.approx(1e-8 / 4 if g["hidden"] else 1e-8)
        assert g["lr"] == pytest.approx(lr / 4 if g["hidden"] else lr)
    assert any(g["hidden"] for g in t.optimizer.adam.param_groups)


def test_hugging_face_export_refuses_mup():
    with pytest.raises(ConversionError, match="muP"):
        check_representable(ModelConfig(**{"hidden_size": 64, **LLAMA, "use_mup": True}), "llama")
