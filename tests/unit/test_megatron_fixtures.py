"""``paratron convert --from megatron`` on checkpoints Megatron-LM itself wrote (tests/data/megatron_ckpt: Megatron
Core 0.16.1's save_checkpoint at TP 2, dense and MoE, torch_dist and legacy): the converted paratron model computes
Megatron's logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratron.checkpoint import convert as C
from paratron.model.gpt import GPTModel

DATA = Path(__file__).resolve().parent.parent / "data" / "megatron_ckpt"
CASES = [("dist", "gpt_tp2"), ("legacy", "gpt_tp2"), ("legacy", "moe_seq_tp2"), ("dist", "moe_gg_tp2"),
         ("legacy", "moe_gg_tp2")]


@pytest.mark.parametrize("fmt,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_converted_megatron_checkpoint_gives_megatrons_logits(tmp_path, fmt, case):
    ref = torch.load(DATA / f"reference_{case}.pt", weights_only=True)
    flags = C.from_megatron(DATA / f"{fmt}_{case}", tmp_path / "out", log=lambda *a: None)
    assert "--norm-epsilon" in flags and ("--num-experts" in flags) == case.startswith("moe")
    cfg, _, _, state = C.read_checkpoint(tmp_path / "out", log=lambda *a: None)
    assert (cfg.model.norm_epsilon, cfg.model.disable_bias_linear, cfg.padded_vocab_size) == (1e-6, True, 128)
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"]).float()
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max() < 1e-4 * ref["logits"].abs().max()  # fp32: ~1e-6 of 5
