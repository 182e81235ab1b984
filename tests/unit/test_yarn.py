"""YaRN frequencies and attention factor against transformers' ``_compute_yarn_parameters``."""
import math

import pytest
import torch

from paratron.model.yarn import YarnParams, correction_range, yarn_concentration_factor, yarn_inv_freq

rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
from transformers import LlamaConfig  # noqa: E402


def _hf(dim, base, factor, original, beta_fast, beta_slow, truncate):
    cfg = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, max_position_embeddings=original * 4,
                      rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                       "original_max_position_embeddings": original, "beta_fast": beta_fast,
                                       "beta_slow": beta_slow, "truncate": truncate})
    return rope_utils._compute_yarn_parameters(cfg, "cpu")


@pytest.mark.parametrize("dim,base,factor,original,fast,slow,rnd", [
    (64, 150000.0, 32.0, 4096, 32.0, 1.0, False),  # gpt-oss
    (64, 10000.0, 40.0, 4096, 32.0, 1.0, True),  # DeepSeek-V3-like (its rope head dim)
    (128, 500000.0, 4.0, 8192, 16.0, 2.0, True),
])
def test_inv_freq_and_factor_match_transformers(dim, base, factor, original, fast, slow, rnd):
    p = YarnParams(scaling_factor=factor, original_max_position_embeddings=original, beta_fast=fast,
                   beta_slow=slow, round_to_int=rnd)
    ref_inv, ref_factor = _hf(dim, base, factor, original, fast, slow, rnd)
    torch.testing.assert_close(yarn_inv_freq(dim, base, p), ref_inv.float(), rtol=1e-6, atol=0)
    assert yarn_concentration_factor(p) == pytest.approx(ref_factor, rel=1e-12)


def test_hand_computed_pieces():
    p = YarnParams(scaling_factor=4.0, original_max_position_embeddings=4096)
    # pair index turning 32 times over 4096 positions with base 10000, dim 64
    low = 64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000))
    high = 64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000))
    assert correction_range(64, 10000.0, p) == (math.floor(low), math.ceil(high))
    inv = yarn_inv_freq(64, 10000.0, p)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1].item() / 4)
    # Megatron's mscale / mscale_all_dim ratio (DeepSeek: both 0.707 -> 1.0)
    assert yarn_concentration_factor(p) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert yarn_concentration_factor(YarnParams(40.0, mscale=0.707, mscale_all_dim=0.707)) == pytest.approx(1.0)
    assert yarn_concentration_factor(YarnParams(1.0)) == 1.0


def test_enable_gpt_oss_is_megatrons_yarn_preset_and_the_modelopt_flags_have_answers():
    """--enable-gpt-oss (Megatron's post-training group) sets the YaRN values of HF's gpt-oss configs over what
    was given; --export-force-local-attention is accepted (one attention implementation), the other
    modelopt-generic flags are refused by name."""
    from paratron.config import ConfigError
    from paratron.train.resolve import parse_args
    base = ["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--position-embedding-type", "rope"]
    m = parse_args(base + ["--enable-gpt-oss", "--export-force-local-attention"]).model
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast, m.yarn_beta_slow, m.mscale, m.mscale_all_dim, m.yarn_correction_range_round_to_int) == (
        "yarn", 32.0, 131072, 32.0, 1.0, 1.0, 0.0, False)
    assert parse_args(base).model.position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="--export-quant-cfg .*Model Optimizer"):
        parse_args(base + ["--export-quant-cfg", "fp8"])
