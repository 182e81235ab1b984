"""paratron -> Hugging Face directory -> transformers.from_pretrained gives the same logits; Hugging Face ->
paratron -> Hugging Face is exact; config round trips; loading directories; one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import hf_config as HC  # noqa: E402
from paratron.checkpoint.hf_config import ConversionError  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402

VOCAB, PADDED, TOL = 100, 128, 1e-5

_LLAMA = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
              num_query_groups=2, seq_length=32, max_position_embeddings=64, position_embedding_type="rope",
              normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
_GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
             openai_gelu=True, hidden_dropout=0.0, attention_dropout=0.0)

# name -> (family, ModelConfig kwargs, position offset of the test tokens)
PARATRON_CASES = {
    "gpt2": ("gpt2", dict(_GPT2), 0),
    "gpt2-untied-exact-gelu": ("gpt2", dict(_GPT2, ffn_hidden_size=80, openai_gelu=False,
                                            untie_embeddings_and_output_weights=True), 0),
    "llama": ("llama", dict(_LLAMA), 0),
    "llama-rope-scaling-tied-bias": ("llama", dict(_LLAMA, max_position_embeddings=16384, rotary_base=500000.0,
                                                   use_rope_scaling=True, rope_scaling_factor=8.0,
                                                   untie_embeddings_and_output_weights=False,
                                                   disable_bias_linear=False), 8000),
    "mistral": ("mistral", dict(_LLAMA, kv_channels=32, rotary_base=1e6), 0),
    "qwen2": ("qwen2", dict(_LLAMA, add_qkv_bias=True, untie_embeddings_and_output_weights=False), 0),
    "qwen3": ("qwen3", dict(_LLAMA, kv_channels=16, qk_layernorm=True), 0),
}

_HF_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
HF_CASES = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                          eos_token_id=0)),
    "llama": ("llama", dict(_HF_LLAMA)),
    "llama-tied-bias": ("llama", dict(_HF_LLAMA, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(_HF_LLAMA, head_dim=32)),
    "qwen2": ("qwen2", dict(_HF_LLAMA, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(_HF_LLAMA, head_dim=16)),
}


def paratron_model(case: str):
    family, kwargs, offset = PARATRON_CASES[case]
    cfg = ModelConfig(**kwargs).resolved()
    model = GPTModel(cfg, PADDED)
    randomize(model)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[VOCAB:] = 0  # HF has no padded rows
    return model.eval(), cfg, family, offset


def hf_model(case: str):
    model_type, kwargs = HF_CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("case", list(PARATRON_CASES))
def test_saved_dir_loads_in_transformers_with_same_logits(case, tmp_path):
    model, cfg, family, offset = paratron_model(case)
    H.save_hf_dir(tmp_path, model.state_dict(), cfg, family, VOCAB)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(loaded).__name__ == HC._ARCHITECTURES[family]
    tied = not cfg.untie_embeddings_and_output_weights
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied  # as save_pretrained writes it
        assert f.metadata() == {"format": "pt"}
    if tied:
        assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(offset, offset + 16).expand(2, 16)
    with torch.no_grad():
        ours = model(ids, position_ids=pos)[..., :VOCAB]
        theirs = loaded.eval()(input_ids=ids, position_ids=pos).logits
    assert theirs.shape == (2, 16, VOCAB)
    assert (ours - theirs).abs().max().item() <= TOL

    # ... and the written config reads back as the same paratron config.
    back, vocab, fam = HC.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (vocab, fam) == (VOCAB, family)
    keep = ("seq_length",)  # seq_length is a training choice: config.json has no field for it
    for field in vars(cfg):
        if field not in keep:
            assert getattr(back, field) == getattr(cfg, field), field


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_round_trip_is_exact(case, tmp_path):
    model = hf_model(case)
    model.save_pretrained(tmp_path)
    hf_state, hf_config = H.load_hf_dir(tmp_path)  # exactly the tensors save_pretrained writes
    cfg, vocab, family = HC.model_config_from_hf(hf_config)
    state = H.hf_to_paratron(hf_state, cfg, family, HC.padded_vocab_size(vocab, cfg))
    GPTModel(cfg, PADDED).load_state_dict(state, strict=True)
    back = H.paratron_to_hf(state, cfg, family, vocab)
    assert back.keys() == hf_state.keys()
    for name, t in hf_state.items():
        assert torch.equal(back[name], t), name
    # also from the in-memory state dict, which has lm_head.weight even when tied
    again = H.hf_to_paratron(model.state_dict(), cfg, family, PADDED)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_name_table_covers_every_parameter():
    _, cfg, family, _ = paratron_model("qwen3")
    rows = H.name_table(cfg, family)
    assert [r[0] for r in rows] == list(GPTModel(cfg, PADDED).state_dict())
    assert ("decoder.layers.1.self_attention.linear_qkv.weight",
            ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.1.self_attn.v_proj.weight"), "qkv") in rows
    assert ("decoder.layers.0.self_attention.q_layernorm.weight", ("model.layers.0.self_attn.q_norm.weight",),
            "copy") in rows


def test_qkv_layout_helpers():
    heads, groups, d = 4, 2, 3
    q = torch.arange(heads * d).float().unsqueeze(1) + 100
    k = torch.arange(groups * d).float().unsqueeze(1) + 200
    v = torch.arange(groups * d).float().unsqueeze(1) + 300
    fused = H.fuse_qkv(q, k, v, heads, groups)[:, 0]
    # group 0: q heads 0 and 1, k head 0, v head 0; then group 1
    expect = [100, 101, 102, 103, 104, 105, 200, 201, 202, 300, 301, 302,
              106, 107, 108, 109, 110, 111, 203, 204, 205, 303, 304, 305]
    assert fused.tolist() == expect
    assert all(torch.equal(a, b) for a, b in zip(H.split_qkv(H.fuse_qkv(q, k, v, heads, groups), heads, groups),
                                                  (q, k, v)))
    c_attn = torch.randn(8, 24)  # GPT-2 Conv1D [in, 3*out]
    assert torch.equal(H.qkv_to_c_attn(H.c_attn_to_qkv(c_attn, 4), 4), c_attn)
    gate, up = torch.randn(5, 3), torch.randn(5, 3)
    assert all(torch.equal(a, b) for a, b in zip(H.split_gate_up(H.fuse_gate_up(gate, up)), (gate, up)))


def test_load_sharded_safetensors_and_pytorch_bin(tmp_path):
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded, config = H.load_hf_dir(tmp_path / "sharded")
    assert config["model_type"] == "llama"
    (tmp_path / "bin").mkdir()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    from_bin, _ = H.load_hf_dir(tmp_path / "bin")
    assert sharded.keys() <= from_bin.keys()
    assert all(torch.equal(sharded[k], from_bin[k]) for k in sharded)


def test_published_gpt2_names_are_accepted():
    """The original gpt2 checkpoints have no ``transformer.`` prefix and store the causal-mask buffers."""
    model = hf_model("gpt2")
    cfg, vocab, family = HC.model_config_from_hf(model.config)
    bare = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    bare["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    ref = H.hf_to_paratron(model.state_dict(), cfg, family, PADDED)
    got = H.hf_to_paratron(bare, cfg, family, PADDED)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_save_with_dtype_and_extra_config(tmp_path):
    model, cfg, family, _ = paratron_model("llama")
    H.save_hf_dir(tmp_path, model.state_dict(), cfg, family, VOCAB, dtype=torch.bfloat16,
                  extra_config={"eos_token_id": 7})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 7
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "model.safetensors")).values())
    with pytest.raises(ConversionError, match="empty directory"):
        (tmp_path / "model.safetensors.index.json").write_text("{}")
        H.save_hf_dir(tmp_path, model.state_dict(), cfg, family, VOCAB)


def test_model_config_from_legacy_config_json():
    """transformers-4 style keys (rope_theta, rope_scaling with 'type') read like transformers-5 ones."""
    d = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
         "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}
    cfg, vocab, family = HC.model_config_from_hf(d)
    assert (vocab, family) == (128256, "llama")
    assert cfg.use_rope_scaling and cfg.rotary_base == 500000.0 and cfg.num_query_groups == 1
    assert cfg.group_query_attention and not cfg.untie_embeddings_and_output_weights
    assert HC.padded_vocab_size(vocab, cfg) == 128256
    mistral = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32768,
               "sliding_window": 4096}
    assert HC.model_config_from_hf(mistral)[0].seq_length == 4096  # paratron has no sliding window
    gpt2 = HC.model_config_from_hf({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 64, "n_layer": 2,
                                   "n_head": 4, "n_positions": 1024})[0]
    assert gpt2.hidden_dropout == 0.1 and gpt2.attention_dropout == 0.1 and gpt2.openai_gelu
    assert gpt2.ffn_hidden_size == 256 and not gpt2.untie_embeddings_and_output_weights


def test_errors_are_one_line_and_name_the_problem():
    def err(fn, *args):
        with pytest.raises(ConversionError) as e:
            fn(*args)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "unsupported model_type 'bert'" in err(HC.model_config_from_hf, {"model_type": "bert", "vocab_size": 10})
    llama3 = {**_HF_LLAMA, "model_type": "llama",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert "low_freq_factor=2.0" in err(HC.model_config_from_hf, llama3)
    yarn = {**_HF_LLAMA, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert "'yarn'" in err(HC.model_config_from_hf, yarn)

    model = hf_model("llama")
    cfg, vocab, family = HC.model_config_from_hf(model.config)
    state = model.state_dict()
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    assert "model.layers.1.mlp.up_proj.weight" in err(H.hf_to_paratron, missing, cfg, family, PADDED)
    bad = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    assert "shape mismatch for model.layers.0.self_attn.k_proj.weight" in err(H.hf_to_paratron, bad, cfg, family,
                                                                              PADDED)
    extra = dict(state, **{"model.layers.2.input_layernorm.weight": torch.ones(64)})
    assert "model.layers.2.input_layernorm.weight" in err(H.hf_to_paratron, extra, cfg, family, PADDED)
    assert "padded_vocab_size 64" in err(H.hf_to_paratron, state, cfg, family, 64)
    assert "unsupported model family 'gpt3'" in err(H.hf_to_paratron, state, cfg, "gpt3", PADDED)

    pstate = H.hf_to_paratron(state, cfg, family, PADDED)
    short = {k: v for k, v in pstate.items() if k != "decoder.final_layernorm.weight"}
    assert "decoder.final_layernorm.weight" in err(H.paratron_to_hf, short, cfg, family, VOCAB)
    assert "gpt2 cannot represent this model" in err(HC.hf_config_from_model_config, cfg, VOCAB, "gpt2")
    assert "qwen2" in err(H.paratron_to_hf, pstate, ModelConfig(**dict(_LLAMA, add_qkv_bias=True)), "llama", VOCAB)


def test_load_hf_dir_errors(tmp_path):
    with pytest.raises(ConversionError, match="not a directory"):
        H.load_hf_dir(tmp_path / "nope")
    with pytest.raises(ConversionError, match="no config.json"):
        H.load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match="has no weights"):
        H.load_hf_dir(tmp_path)


def test_docs_example_runs(capsys):
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
    code = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[-1]
    exec(compile(code, str(doc), "exec"), {})
    assert capsys.readouterr().out.strip() == "llama 2 torch.Size([1, 8, 1000])"


def test_saved_files_follow_the_umask(tmp_path):
    """safetensors writes 0600; an export is shared like any other file the user writes."""
    import os
    model, cfg, family, _ = paratron_model("llama")
    old = os.umask(0o022)
    try:
        H.save_hf_dir(tmp_path, model.state_dict(), cfg, family, VOCAB)
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644
