"""T5 v1.1 <-> transformers' T5ForConditionalGeneration: a random small model's logits equal both ways (fp32)."""
import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf_t5 import (model_config_from_t5, paratron_to_t5, t5_config_from_model_config,
                                       t5_to_paratron)
from paratron.checkpoint.hf_config import ConversionError
from paratron.model.t5 import T5Model

VOCAB = 100


def hf_model(seed=0):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF's init leaves the relative tables and norms at values that hide mistakes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        model.shared.weight.mul_(0.1)  # logits of order 1: the 1e-5 below is about the computation, not their size
    return model


def inputs():
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, VOCAB, (2, 14), generator=g)
    dec = torch.randint(2, VOCAB, (2, 9), generator=g)
    pad = torch.ones(2, 14, dtype=torch.bool)
    pad[1, 10:] = False
    return enc, dec, pad


def paratron_from(hf):
    cfg = model_config_from_t5(hf.config.to_dict(), seq_length=32).resolved()
    model = T5Model(cfg, 128).eval()
    model.load_state_dict(t5_to_paratron(hf.state_dict(), cfg, 128))
    return model, cfg


def test_hf_to_paratron_logits_equal():
    hf = hf_model()
    model, _ = paratron_from(hf)
    enc, dec, pad = inputs()
    with torch.no_grad():
        want = hf(input_ids=enc, attention_mask=pad.long(), decoder_input_ids=dec).logits
        got = model(enc, dec, encoder_padding_mask=pad)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_paratron_to_hf_logits_equal(tmp_path):
    hf = hf_model(seed=3)
    model, cfg = paratron_from(hf)
    with torch.no_grad():  # new weights on the paratron side, then back to transformers
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    # written as a model directory: transformers 5 ties lm_head to shared in memory, and keeps them apart
    # when a checkpoint holds two different tensors
    (tmp_path / "config.json").write_text(json.dumps(t5_config_from_model_config(cfg, VOCAB)))
    save_file(paratron_to_t5(model.state_dict(), cfg, VOCAB), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    # transformers' eager attention: its SDPA path (T5's default in transformers 5.25) sums in another order, 1.2e-5
    # apart here, past the 1e-5 that checks the conversion
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    assert not torch.equal(back.lm_head.weight, back.shared.weight)
    enc, dec, pad = inputs()
    with torch.no_grad():
        want = model.eval()(enc, dec, encoder_padding_mask=pad)[..., :VOCAB]
        got = back.eval()(input_ids=enc, attention_mask=pad.long(), decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_refuses_tied_t5():
    with pytest.raises(ConversionError, match="rescales the decoder output"):
        model_config_from_t5({"feed_forward_proj": "gated-gelu", "tie_word_embeddings": True, "num_layers": 1})


def test_greedy_generation_equals_transformers():
    """Encoder once, decoder step by step over the KV cache: transformers' greedy tokens, token for token."""
    from paratron.inference.sampling import SamplingParams
    from paratron.inference.t5_generate import generate_t5
    hf = hf_model(seed=5)
    model, _ = paratron_from(hf)
    enc, _, pad = inputs()
    # (transformers 5.24 sizes its decoder cache by num_layers, which fails with more decoder layers: no cache there)
    want = hf.generate(input_ids=enc, attention_mask=pad.long(), max_new_tokens=12, do_sample=False,
                       use_cache=False)[:, 1:]
    got = generate_t5(model, enc, pad.long(), SamplingParams(max_new_tokens=12), VOCAB, eos=1)
    assert got.tolist() == want.tolist()
    sampled = [generate_t5(model, enc, pad.long(), SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5,
                                                                    seed=3), VOCAB, eos=None) for _ in range(2)]
    assert sampled[0].shape == (2, 6) and sampled[0].tolist() == sampled[1].tolist()  # seeded: repeatable


def test_load_hf_t5_directory_for_generation(tmp_path):
    """``paratron generate --load HF_T5_DIR`` reads it as a T5Model with transformers' logits."""
    from paratron.inference.load import is_t5, load_for_inference
    hf = hf_model(seed=7)
    hf.save_pretrained(tmp_path)
    assert is_t5(tmp_path)
    loaded = load_for_inference(tmp_path)
    enc, dec, pad = inputs()
    with torch.no_grad():
        want = hf(input_ids=enc, attention_mask=pad.long(), decoder_input_ids=dec).logits
        got = loaded.model(enc, dec, encoder_padding_mask=pad)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_convert_round_trip_through_a_paratron_checkpoint(tmp_path):
    """paratron convert --from hf (T5 directory -> checkpoint) then --to hf: transformers' logits again."""
    from paratron.checkpoint.convert import from_hf, to_hf
    hf = hf_model(seed=9)
    hf.save_pretrained(tmp_path / "hf")
    flags = from_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert "--decoder-num-layers" in flags and "--geglu" in flags
    to_hf(tmp_path / "ckpt", tmp_path / "back")
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    enc, dec, pad = inputs()
    with torch.no_grad():
        want = hf(input_ids=enc, attention_mask=pad.long(), decoder_input_ids=dec).logits
        got = back(input_ids=enc, attention_mask=pad.long(), decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_t5_generation_under_several_ranks_is_one_line(monkeypatch, tmp_path):
    """T5 generation is one process: under torchrun with two ranks it stops with one line before loading
    anything (each rank would otherwise generate and print the same answers)."""
    import types

    from paratron.errors import ConfigError
    from paratron.inference.sampling import SamplingParams
    from paratron.inference.t5_generate import generate_main
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = types.SimpleNamespace(load=str(tmp_path / "missing"), device="cpu", dtype=None, iteration=None)
    with pytest.raises(ConfigError, match="one process, not 2"):
        generate_main(args, SamplingParams(max_new_tokens=2))


def test_t5_generation_refuses_the_decode_kernel_switches_by_name(tmp_path, capsys):
    """T5's decoder loop takes no kernel switches: `paratron generate --kernel-decode-attention fused` on a T5
    stops with one line naming the flag (it is not silently ignored)."""
    from paratron.cli import main
    hf_model(seed=3).save_pretrained(tmp_path)
    assert main(["generate", "--load", str(tmp_path), "--prompt", "x", "--kernel-decode-attention", "fused"]) == 2
    err = capsys.readouterr().err
    assert "--kernel-decode-attention fused" in err and "T5" in err
