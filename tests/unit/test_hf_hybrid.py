"""Hugging Face both ways for hybrid stacks: tiny random Mamba2ForCausalLM, NemotronHForCausalLM (with and without
MoE layers) and Qwen3NextForCausalLM models converted to paratron give their logits (fp32, within 1e-5; 3e-5 with
experts) and their greedy tokens; converted back, transformers loads them and gives the same logits. What the
mapping cannot express is refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import hf_config as HC  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from tests.unit.test_hf_parity import VOCAB, build_hf, to_paratron, tokens  # noqa: E402

NEMOTRON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=8,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
# NemotronH's MoE layers (Nemotron-3 Nano's): sigmoid router with the expert bias (randomised in hf_model) and a
# scaling, ungated squared-ReLU experts, the shared expert
NEMOTRON_MOE = dict(NEMOTRON, hybrid_override_pattern="M*E-E", n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_shared_experts=1,
                    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1)
MAMBA = dict(hidden_size=32, state_size=8, head_dim=8, num_heads=8, n_groups=2, expand=2, conv_kernel=4,
             chunk_size=8, layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)
CASES = {
    "mamba2-untied": ("mamba2", dict(MAMBA, num_hidden_layers=2, tie_word_embeddings=False)),
    "mamba2-tied": ("mamba2", dict(MAMBA, num_hidden_layers=1, tie_word_embeddings=True)),
    # a dt floor of 0.6 that binds for part of the tokens (NemotronH's: time_step_limit in transformers 5.25,
    # time_step_min in 5.18; both set)
    "qwen3_next": ("qwen3_next", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                                      linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
                                      mlp_only_layers=[0, 1, 2, 3], rms_norm_eps=1e-6, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5},
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # Qwen3-Next's real layout: MoE layers (router, experts, the sigmoid-gated shared expert) and here one dense layer
    "qwen3_next-moe": ("qwen3_next", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                          linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                          decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                                          rms_norm_eps=1e-6, max_position_embeddings=64,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5},
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "nemotron_h": ("nemotron_h", dict(NEMOTRON, hybrid_override_pattern="M*-M", time_step_min=0.6,
                                      time_step_limit=(0.6, float("inf")))),
    "nemotron_h-moe": ("nemotron_h", NEMOTRON_MOE),
    # the routed experts in a latent width (moe_latent_size) and group-limited routing (the best of 2 groups)
    "nemotron_h-latent-groups-moe": ("nemotron_h", dict(NEMOTRON_MOE, hybrid_override_pattern="ME*E",
                                                        moe_latent_size=12, n_group=2, topk_group=1)),
}


def hf_model(name):
    model_type, kw = CASES[name]
    hf = build_hf(model_type, dict(kw, vocab_size=VOCAB))
    with torch.no_grad():  # transformers starts the routers' expert bias at zeros: make a missed bias show
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)) * 0.5)
    return hf


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_equal_transformers(name):
    hf = hf_model(name)
    model, vocab, _ = to_paratron(hf)
    ids, _ = tokens(s=12)
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :vocab]
    # within tol of the largest logit: fp32 sums in another order (the experts' outputs; the chunked delta rule's,
    # whose difference depends on the CPU's BLAS kernels: 3.1e-5 of 6.3 on an AMD EPYC, below 1e-5 elsewhere)
    tol = (3e-5 if name.endswith("moe") else 1e-5) * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    out = Engine(model, vocab).generate([Request(ids[0, :5].tolist(), SamplingParams(max_new_tokens=6))])[0]
    seq = torch.tensor([ids[0, :5].tolist() + out.tokens])
    with torch.no_grad():
        assert out.tokens == hf(seq).logits[0, 4:-1].argmax(-1).tolist()  # each one transformers' greedy choice


@pytest.mark.parametrize("name", ["mamba2-untied", "nemotron_h", "qwen3_next", "qwen3_next-moe", "nemotron_h-moe",
                                  "nemotron_h-latent-groups-moe"])
def test_converted_back_loads_in_transformers(name, tmp_path):
    hf = hf_model(name)
    model, vocab, _ = to_paratron(hf)
    cfg, family = model.config, HC.family_of(hf.config)
    H.save_hf_dir(tmp_path / "hf", model.state_dict(), cfg, family, vocab)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(back) is type(hf)
    ids, _ = tokens(s=12)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_refusals():
    moe = dict(NEMOTRON_MOE, model_type="nemotron_h", vocab_size=VOCAB, layers_block_type=["linear_attention", "moe"])
    for bad, why in ((dict(norm_topk_prob=False), "norm_topk_prob false"),
                     (dict(n_group=2, topk_group=1, num_experts_per_tok=3), "group-limited routing"),
                     (dict(num_experts_per_tok=1), "norm_topk_prob true with num_experts_per_tok 1"),
                     (dict(mlp_bias=True), "MLP without biases"), (dict(num_nextn_predict_layers=1), "multi-token")):
        with pytest.raises(HC.ConversionError, match=why):
            HC.model_config_from_hf(dict(moe, **bad))
    cfg = HC.model_config_from_hf(moe)[0]
    with pytest.raises(HC.ConversionError, match="ungated shared expert"):
        HC.hf_config_from_model_config(dataclasses.replace(cfg, moe_shared_expert_gate=True), VOCAB, "nemotron_h")
    gdn = ModelConfig(hidden_size=32, num_attention_heads=4, hybrid_layer_pattern="MG", normalization="RMSNorm",
                      disable_bias_linear=True, position_embedding_type="none", mamba_state_dim=8,
                      mamba_head_dim=8, mamba_num_groups=2, linear_num_key_heads=2, linear_num_value_heads=4)
    with pytest.raises(HC.ConversionError, match="its layers are M"):
        HC.hf_config_from_model_config(gdn, VOCAB, "nemotron_h")
    with pytest.raises(HC.ConversionError, match="use mamba2, nemotron_h or qwen3_next"):
        HC.hf_config_from_model_config(gdn, VOCAB, "llama")


def test_tagged_floats_of_transformers_5_config_files_are_read(tmp_path):
    """transformers 5.x writes inf into config.json as {"__float__": "Infinity"} (NemotronH's time_step_limit): the
    config reads back with the floor it gives."""
    import json
    hf = hf_model("nemotron_h")
    hf.config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["time_step_limit"] = [0.25, {"__float__": "Infinity"}]
    cfg, _, family = HC.model_config_from_hf(d)
    assert family == "nemotron_h" and cfg.mamba_dt_limit_min == 0.25
    assert HC.decode_floats({"a": [1, {"__float__": "-Infinity"}], "b": {"__float__": "x"}}) == \
        {"a": [1, float("-inf")], "b": {"__float__": "x"}}
    d["time_step_limit"] = [0.0, 5.0]
    with pytest.raises(H.ConversionError, match="no upper dt limit"):
        HC.model_config_from_hf(d)
