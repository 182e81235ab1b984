import pytest

from paratron.config import Config, ConfigError, apply_dict, parse_args, reference_markdown

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "5", "--lr", "1e-3", "--mock-data"]


def test_flags_map_to_megatron_named_fields():
    cfg = parse_args(BASE + ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                             "--num-query-groups", "2"])
    assert cfg.model.hidden_size == 64 and cfg.model.swiglu and cfg.model.num_query_groups == 2
    assert cfg.model.kv_channels == 16
    assert cfg.model.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
    assert cfg.flat().num_layers == 2


def test_misspelt_flag_names_it_and_suggests():
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + ["--hiden-size", "64"])
    msg = str(e.value)
    assert "--hiden-size" in msg and "--hidden-size" in msg and "\n" not in msg


def test_unsupported_megatron_flag_is_named():
    with pytest.raises(ConfigError, match="--num-experts.*not support"):
        parse_args(BASE + ["--num-experts", "8"])


@pytest.mark.parametrize("extra,needle", [
    (["--hidden-size", "66"], "not divisible by --num-attention-heads"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
    (["--lr-decay-style", "exp"], "--lr-decay-style"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], "exceeds --max-position-embeddings"),
    (["--hidden-size", "abc"], "invalid int value"),
])
def test_validation_errors_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_essentials():
    with pytest.raises(ConfigError, match="--train-iters"):
        parse_args(["--lr", "1", "--mock-data"])
    with pytest.raises(ConfigError, match="--lr"):
        parse_args(["--train-iters", "1", "--mock-data"])
    with pytest.raises(ConfigError, match="no training data"):
        parse_args(["--train-iters", "1", "--lr", "1"])


def test_yaml_flat_and_sectioned_then_flags_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  hidden_size: 128\n  num_attention_heads: 8\nnum_layers: 3\nlr: 2.0e-4\n"
                 "train_iters: 7\nmock_data: true\n")
    cfg = parse_args(["--config", str(f), "--num-layers", "5"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.optim.lr, cfg.train.train_iters) == (128, 5, 2e-4, 7)
    f.write_text("hiden_size: 3\n")
    with pytest.raises(ConfigError, match="did you mean --hidden-size"):
        parse_args(["--config", str(f)])
    f.write_text("hidden_size: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_args(["--config", str(f)])


@pytest.mark.parametrize("preset", ["tiny", "gpt-125m", "gpt-350m", "llama-1b"])
def test_presets_load(preset):
    cfg = parse_args(["--config", preset])
    assert cfg.model.num_layers >= 2


def test_llama_preset_shape():
    cfg = parse_args(["--config", "llama-1b"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.ffn_hidden_size) == (16, 2048, 8, 8192)
    assert cfg.padded_vocab_size == 32768


def test_vocab_padding_follows_megatron():
    cfg = Config()
    cfg.data.vocab_size = 50257
    assert cfg.padded_vocab_size == 50304
    cfg.parallel.tensor_model_parallel_size = 8
    assert cfg.padded_vocab_size == 51200  # multiple of 128 x TP


def test_apply_dict_type_errors():
    with pytest.raises(ConfigError, match="hidden_size: expected int"):
        apply_dict(Config(), {"hidden_size": "big"}, "test")


def test_reference_lists_every_field():
    md = reference_markdown()
    for name in ("--tensor-model-parallel-size", "--lr-decay-style", "--data-path", "--save-interval"):
        assert name in md


def test_docs_config_reference_is_current():
    from pathlib import Path
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == reference_markdown(), "regenerate with: python tools/gen_config_docs.py"


def test_data_path_on_the_command_line_replaces_preset_mock_data():
    cfg = parse_args(["--config", "tiny", "--data-path", "some/prefix"])
    assert not cfg.data.mock_data and cfg.data.data_path == ["some/prefix"]


def test_boolean_flag_takes_an_optional_value_to_turn_off_a_yaml_setting():
    from paratron.config import ConfigError, parse_args
    assert parse_args(["--config", "llama-1b"]).train.bf16 is True
    assert parse_args(["--config", "llama-1b", "--bf16", "false"]).train.bf16 is False
    assert parse_args(["--config", "llama-1b", "--bf16=off"]).train.bf16 is False
    cfg = parse_args(["--config", "tiny", "--bf16", "--train-iters", "3"])  # Megatron's bare form
    assert cfg.train.bf16 is True and cfg.train.train_iters == 3
    with pytest.raises(ConfigError, match="expected true or false"):
        parse_args(["--config", "tiny", "--bf16", "maybe"])
