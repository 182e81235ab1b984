"""Mixtral, Qwen2-MoE and Qwen3-MoE <-> paratron: tiny random transformers models give paratron's logits (fp32,
within 1e-5) whichever way they are converted; Hugging Face -> paratron -> Hugging Face is exact (the
per-expert checkpoint files, and transformers 5's fused in-memory experts); `paratron convert --from hf`
gives a checkpoint that `pretrain_gpt.py` trains from starting at the Hugging Face model's loss, and
the trained checkpoint converts back to a directory transformers loads with paratron's logits;
unsupported MoE features are one-line errors."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import hf_config as HC  # noqa: E402
from paratron.checkpoint.hf_config import ConversionError  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402
from tests.unit.test_convert_cli import (_first_batch, _printed_command, _run_all, convert,  # noqa: E402
                                         paratron_from_checkpoint)
from tests.unit.test_hf_parity import randomize  # noqa: E402

VOCAB, PADDED, TOL = 100, 128, 1e-5
_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
             num_experts_per_tok=2)
# name -> (model_type, config kwargs)
CASES = {
    "mixtral": ("mixtral", dict(_BASE, num_local_experts=4, router_aux_loss_coef=0.02)),
    "mixtral-tied-top1": ("mixtral", dict(_BASE, num_local_experts=4, num_experts_per_tok=1,
                                          tie_word_embeddings=True)),
    # norm_topk_prob true: Megatron's top-k then softmax; a dense layer 1 (mlp_only_layers)
    "qwen3_moe-norm-topk-dense-last": ("qwen3_moe", dict(_BASE, num_experts=4, moe_intermediate_size=48,
                                                         norm_topk_prob=True, mlp_only_layers=[1])),
    # norm_topk_prob false: softmax over all experts, top-k, no renormalisation (--moe-router-pre-softmax);
    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE
    "qwen3_moe-pre-softmax-step2": ("qwen3_moe", dict(_BASE, num_experts=4, moe_intermediate_size=48,
                                                      norm_topk_prob=False, decoder_sparse_step=2, head_dim=16)),
    # Qwen2-MoE: q/k/v biases, the sigmoid-gated shared expert (--moe-shared-expert-gate), softmax over all experts
    # without renormalisation (its default norm_topk_prob false); a dense layer 1
    "qwen2_moe-shared-expert": ("qwen2_moe", dict(_BASE, num_experts=4, moe_intermediate_size=48,
                                                  shared_expert_intermediate_size=40, mlp_only_layers=[1])),
}


def build_hf(case: str, seed: int = 0):
    model_type, kwargs = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()


def to_paratron(hf_state: dict, hf_config, **changes):
    """GPTModel with the converted weights; ``changes`` to its config after the conversion."""
    cfg, vocab, family = HC.model_config_from_hf(hf_config)
    state = H.hf_to_paratron(hf_state, cfg, family, PADDED)
    cfg = cfg.resolved(**changes) if changes else cfg
    model = GPTModel(cfg, PADDED)
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg, family


IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def max_diff(model, hf_model) -> float:
    with torch.no_grad():
        return (model(IDS)[..., :VOCAB] - hf_model(input_ids=IDS).logits).abs().max().item()


def test_config_mapping():
    mixtral, _, _ = to_paratron(build_hf("mixtral").state_dict(), build_hf("mixtral").config)
    m = mixtral.config
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (4, 2, 64, "1")
    assert not m.moe_router_pre_softmax and m.moe_aux_loss_coeff == 0.02 and not m.qk_layernorm
    q = {c: HC.model_config_from_hf(build_hf(c).config)[0] for c in CASES if c.startswith("qwen3_moe")}
    a, b = q["qwen3_moe-norm-topk-dense-last"], q["qwen3_moe-pre-softmax-step2"]
    assert (a.moe_layer_freq, a.moe_router_pre_softmax, a.moe_ffn_hidden_size, a.ffn_hidden_size) == ("[1,0]", False,
                                                                                                    48, 64)
    assert (b.moe_layer_freq, b.moe_router_pre_softmax, b.kv_channels) == ("[0,1]", True, 16)
    assert a.qk_layernorm and b.qk_layernorm
    from paratron.checkpoint.convert import default_family, training_flags
    from paratron.config import parse_args
    for cfg, family in ((m, "mixtral"), (a, "qwen3_moe"), (b, "qwen3_moe")):  # the printed flags rebuild it
        assert parse_args(training_flags(cfg) + ["--train-iters", "1", "--lr", "1", "--mock-data"]).model == cfg
        assert default_family(cfg) == family


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case, tmp_path):
    hf_model = build_hf(case)
    # transformers 5's in-memory model (fused experts) and its checkpoint files (one tensor per expert)
    model, cfg, family = to_paratron(hf_model.state_dict(), hf_model.config)
    assert max_diff(model, hf_model) <= TOL
    hf_model.save_pretrained(tmp_path)
    files, config = H.load_hf_dir(tmp_path)
    assert any(".experts.3." in k for k in files)  # per-expert on disk
    model2, _, _ = to_paratron(files, config)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    # Round trip: exactly the files.
    back = H.paratron_to_hf(model.state_dict(), cfg, family, VOCAB)
    assert back.keys() == files.keys() and all(torch.equal(back[k], files[k]) for k in files)
    assert hf_model(input_ids=IDS).logits.std().item() > 0.3


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-pre-softmax-step2"])
def test_router_semantics_are_exercised(case):
    """The other router normalisation gives visibly different logits: the parity above checks it."""
    hf_model = build_hf(case)
    model, cfg, _ = to_paratron(hf_model.state_dict(), hf_model.config,
                                moe_router_pre_softmax=not HC.model_config_from_hf(hf_model.config)[0]
                                .moe_router_pre_softmax)
    assert max_diff(model, hf_model) > 1e-3


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-norm-topk-dense-last", "qwen3_moe-pre-softmax-step2"])
def test_paratron_to_hf_dir_loads_in_transformers(case, tmp_path):
    """A paratron model (its own random weights) -> save_hf_dir -> from_pretrained: same logits, and
    the config.json reads back as the same paratron config."""
    cfg, _, family = HC.model_config_from_hf(build_hf(case).config)
    model = GPTModel(cfg, PADDED)
    randomize(model, seed=2)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[VOCAB:] = 0
        model.output_layer.weight[VOCAB:] = 0
    H.save_hf_dir(tmp_path, model.state_dict(), cfg, family, VOCAB)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(loaded).__name__ == HC._ARCHITECTURES[family]
    assert max_diff(model.eval(), loaded.eval()) <= TOL
    back, vocab, fam = HC.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (vocab, fam) == (VOCAB, family)
    for field in vars(cfg):
        assert getattr(back, field) == getattr(cfg, field), field


def test_errors_are_one_line_and_name_the_feature():
    def err(fn, *args):
        with pytest.raises(ConversionError) as e:
            fn(*args)
        assert "\n" not in str(e.value)
        return str(e.value)

    olmoe = dict(_BASE, model_type="olmoe", num_experts=4)
    assert "q/k norms span all heads" in err(HC.model_config_from_hf, olmoe)
    no_shared = dict(_BASE, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=48,
                     shared_expert_intermediate_size=0)
    assert "always has a shared expert" in err(HC.model_config_from_hf, no_shared)
    jitter = dict(_BASE, model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1)
    assert "router_jitter_noise 0.1" in err(HC.model_config_from_hf, jitter)
    shared = dict(_BASE, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=48,
                  shared_expert_intermediate_size=64)
    assert "shared_expert_intermediate_size 64" in err(HC.model_config_from_hf, shared)
    assert "mlp_only_layers [5]" in err(HC.model_config_from_hf, dict(shared, shared_expert_intermediate_size=0,
                                                                      mlp_only_layers=[5]))
    cfg = HC.model_config_from_hf(build_hf("mixtral").config)[0]
    for changes, family, what in [
            (dict(moe_router_pre_softmax=True), "mixtral", "--moe-router-pre-softmax"),
            (dict(moe_layer_freq="[0,1]"), "mixtral", "--moe-layer-freq 1"),
            (dict(moe_expert_capacity_factor=1.0), "mixtral", "--moe-expert-capacity-factor"),
            (dict(moe_router_score_function="sigmoid"), "mixtral", "softmax"),
            (dict(moe_shared_expert_intermediate_size=32), "qwen3_moe", "shared experts"),
            (dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True), "qwen3_moe", "gated or not"),
            (dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1, moe_aux_loss_coeff=0.0), "mixtral",
             "Sinkhorn routing"),
            (dict(moe_router_num_groups=2, moe_router_group_topk=1), "mixtral", "--moe-router-group-topk"),
            (dict(moe_router_force_load_balancing=True), "qwen3_moe", "--moe-router-force-load-balancing"),
            ({}, "mistral", "--num-experts"), ({}, "qwen3_moe", "needs --qk-layernorm")]:
        assert what in err(HC.hf_config_from_model_config, cfg.resolved(**changes), VOCAB, family), changes
    dense = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", disable_bias_linear=True, seq_length=16)
    assert "needs --num-experts" in err(HC.hf_config_from_model_config, dense, VOCAB, "mixtral")
    hf_model = build_hf("mixtral")
    state = {k: v for k, v in hf_model.state_dict().items() if "layers.1.mlp.experts.down_proj" not in k}
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in err(H.hf_to_paratron, state, cfg, "mixtral",
                                                                       PADDED)


def test_convert_train_and_back(tmp_path, capsys):
    """HF Qwen3-MoE (a dense layer, norm_topk_prob false) and Mixtral directories -> `paratron convert
    --from hf` -> `pretrain_gpt.py` with the printed flags: the first loss is the HF model's on that batch;
    the trained checkpoints -> `convert --to hf` -> transformers gives paratron's logits."""
    data = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--num-workers", "0",
            "--eval-iters", "0", "--log-interval", "1"]
    cmds, hf_models, flags = {}, {}, {}
    for case in ("qwen3_moe-pre-softmax-step2", "mixtral"):
        hf_models[case] = build_hf(case, seed=3)
        hf_models[case].save_pretrained(tmp_path / case)
        assert convert("--from", "hf", "--input", tmp_path / case, "--save", tmp_path / f"{case}.ckpt") == 0
        _, _, printed = _printed_command(capsys.readouterr().out)
        flags[case] = printed[:-3] + data
        cmds[case] = (1, ["pretrain_gpt.py", *printed, *data, "--save", str(tmp_path / f"{case}.trained")])
    assert "--moe-router-pre-softmax" in flags["qwen3_moe-pre-softmax-step2"]
    outs = _run_all(cmds)
    for case, out in outs.items():
        losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+) \|", out)]
        batch = _first_batch(flags[case])
        with torch.no_grad():
            logits = hf_models[case](input_ids=batch["tokens"]).logits
            logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], PADDED - VOCAB)], dim=-1)
            per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                          reduction="none")
            mask = batch["loss_mask"].flatten()
            expected = ((per_token * mask).sum() / mask.sum()).item()
        assert len(losses) == 2 and abs(losses[0] - expected) <= TOL * expected, (case, losses, expected)
        assert abs(expected - math.log(PADDED)) > 0.3  # sharp random weights: far from a fresh init's loss
        assert "load_balancing_loss" in out

        out_dir = tmp_path / f"{case}.hf"
        assert convert("--to", "hf", "--load", tmp_path / f"{case}.trained", "--output", out_dir, "--quiet") == 0
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
        trained = paratron_from_checkpoint(tmp_path / f"{case}.trained")
        assert max_diff(trained, loaded) <= TOL
        before = load_file(str(tmp_path / case / "model.safetensors"))
        after = load_file(str(out_dir / "model.safetensors"))
        assert before.keys() == after.keys()
        assert not torch.equal(before["model.layers.1.self_attn.q_proj.weight"],
                               after["model.layers.1.self_attn.q_proj.weight"])  # trained
