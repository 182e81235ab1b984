"""Issue 49: a Hugging Face directory whose config.json disagrees with its tensors (a vocab_size of 321 beside a
257-row embedding, which transformers refuses) is one line naming both numbers, not a checkpoint with zero rows."""
import json

import pytest

transformers = pytest.importorskip("transformers")
from paratron.checkpoint import convert as C  # noqa: E402

VOCAB = 257


def _tiny_hf(path):
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _set_config(path, capsys, **values):
    capsys.readouterr()  # (transformers' progress bar)
    config = json.loads((path / "config.json").read_text())
    config.update(values)
    (path / "config.json").write_text(json.dumps(config))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("vocab", [321, 200])
def test_a_vocab_size_that_disagrees_with_the_embedding_is_one_line_naming_both(tmp_path, capsys, vocab):
    _tiny_hf(tmp_path / "hf")
    _set_config(tmp_path / "hf", capsys, vocab_size=vocab)
    assert C.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 2
    err = _one_line(capsys)
    assert f"config.json has vocab_size {vocab} but the llama embedding has {VOCAB} rows" in err, err
    assert not (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()


def test_a_hidden_size_that_disagrees_with_the_tensors_is_one_line_naming_both(tmp_path, capsys):
    _tiny_hf(tmp_path / "hf")
    _set_config(tmp_path / "hf", capsys, intermediate_size=64)
    assert C.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 2
    err = _one_line(capsys)
    assert "shape mismatch for model.layers.0.mlp.gate_proj.weight: got (48, 32), the config gives (64, 32)" in err, err


def test_a_matching_directory_converts(tmp_path, capsys):
    _tiny_hf(tmp_path / "hf")
    assert C.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
