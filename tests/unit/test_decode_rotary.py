"""The fused batch-1 decode attention (kernels/decode_rotary.py): its torch reference against the layer's unfused
path (rotation, cache write, decode attention), the kernel against the reference through Triton's CPU interpreter
(one program per group and split contexts, fp32 and bf16), and ``--kernel-decode-attention fused`` through the
engine: the greedy tokens and log-probabilities of the unfused engine, the fused path taken."""
import dataclasses

import pytest
import torch

from paratron.config import KernelConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.sampling import SamplingParams
from paratron.kernels import decode_rotary
from paratron.kernels.decode_attention import decode_attention_reference
from paratron.kernels.rotary import apply_rotary
from paratron.model.gpt import GPTModel
from tests.interpret import interpret
from tests.unit.test_generate import PROMPTS, VOCAB, sharpen, tiny_model


def rope(d: int, position: int):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = position * torch.cat([inv, inv])
    return angles.cos(), angles.sin()


def test_reference_is_the_unfused_rotation_cache_write_and_attention():
    torch.manual_seed(0)
    g, qpg, d, cap, slot = 2, 3, 16, 40, 29
    qkv = torch.randn(g, qpg + 2, d).bfloat16()
    cos, sin = rope(d, 25)
    k_cache, v_cache = torch.randn(2, 1, g, cap, d).bfloat16()
    keep_k, keep_v = k_cache.clone(), v_cache.clone()
    pad, at = torch.tensor([4]), torch.tensor(slot)
    got = decode_rotary.decode_rotary_reference(qkv, cos, sin, k_cache, v_cache, pad, at, 0.3)
    k_rot = apply_rotary(qkv[:, qpg], cos, sin)
    assert torch.equal(k_cache[0, :, slot], k_rot) and torch.equal(v_cache[0, :, slot], qkv[:, qpg + 1])
    keep_k[0, :, slot], keep_v[0, :, slot] = k_rot, qkv[:, qpg + 1]
    assert torch.equal(k_cache, keep_k) and torch.equal(v_cache, keep_v)  # nothing else written
    want = decode_attention_reference(apply_rotary(qkv[:, :qpg], cos, sin)[None], keep_k, keep_v, pad, at, 0.3)
    assert torch.equal(got, want) and got.shape == (1, g, qpg, d)


KERNEL = r"""
import torch
from paratron.kernels.decode_rotary import decode_rotary_reference
torch.manual_seed(0)
# one program per group and split contexts (splits past a short context stay empty), combined by a second kernel or,
# with counts, by each group's last split; padding slots, slots past the current one never read (NaN there), fp32 and
# bf16, 1 and 4 query heads per group
for g, qpg, d, cap, slot, pad, dtype, tol in ((2, 4, 16, 150, 137, 0, torch.float32, 1e-5),
                                              (1, 1, 64, 70, 5, 2, torch.float32, 1e-5),
                                              (8, 4, 64, 200, 190, 3, torch.bfloat16, 2e-2),
                                              (2, 2, 16, 400, 390, 5, torch.float32, 1e-5)):  # auto: 2 splits
    qkv = torch.randn(g, qpg + 2, d, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = (slot - pad) * torch.cat([inv, inv])
    cos, sin = angles.cos(), angles.sin()
    norm = (1 + 0.2 * torch.randn(2, d)).to(dtype)  # the query and key heads' RMSNorm weights (--qk-layernorm)
    # early: the cached slots a split loads at its start (before its wait when launched early), then walks on
    for splits, counts, norms, early in ((1, None, None, 0), (3, None, (norm[0], norm[1], 1e-6), 64),
                                         (0, None, None, 256), (1, None, None, 256),
                                         (3, torch.zeros(g, dtype=torch.int32), None, 0),
                                         (0, torch.zeros(g + 1, dtype=torch.int32), (norm[0], norm[1], 1e-6), 256)):
        k, v = torch.randn(2, 1, g, cap, d, dtype=dtype)
        k[:, :, slot + 1:], v[:, :, slot + 1:] = float("nan"), float("nan")
        k[:, :, :pad], v[:, :, :pad] = float("nan"), float("nan")
        rk, rv = k.nan_to_num(), v.nan_to_num()
        want = decode_rotary_reference(qkv, cos, sin, rk, rv, torch.tensor([pad]), torch.tensor(slot), 0.125, norms)
        none = torch.zeros(0, dtype=torch.int32)  # (no counts: the second kernel combines)
        got = torch.ops.paratron.decode_rotary_attention(qkv, cos, sin, k, v, torch.tensor([pad]), torch.tensor(slot),
                                                         0.125, splits, none if counts is None else counts, False,
                                                         *(norms or (torch.zeros(0), torch.zeros(0), 0.0)), early)
        # the splits counted themselves in and the last one set its group's count back (zero for the next call)
        assert counts is None or not counts.any(), counts
        assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, (g, qpg, d, dtype, splits, norms is not None, early, err)
        # the rotated key and the value at the slot, as the reference wrote them; nothing else written (bf16 within
        # two ulps here; the kernel rounds as torch does through kernels/rotary.py's _round, whose bits the GPU
        # test checks)
        exact = dtype == torch.float32
        assert torch.allclose(k[0, :, slot].float(), rk[0, :, slot].float(), rtol=1e-6 if exact else 3 * 2 ** -8,
                              atol=1e-6 if exact else 2 ** -4), splits  # (2 ulps of |x| < 4)
        assert torch.equal(v[0, :, slot], rv[0, :, slot])
        assert k[:, :, slot + 1:].isnan().all() and k[:, :, :pad].isnan().all() and torch.equal(k[:, :, pad:slot],
                                                                                             rk[:, :, pad:slot])
print("ok")
"""


def test_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    interpret(KERNEL)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_engine_with_the_fused_decode_gives_the_unfused_tokens_and_takes_the_fused_path(monkeypatch, qk_norm):
    plain = tiny_model("llama")
    if qk_norm:  # Qwen3-style --qk-layernorm: each query and key head RMS-normalised before its rotation
        plain = GPTModel(dataclasses.replace(plain.config, qk_layernorm=True).resolved(), 128, seed=3).eval()
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
        sharpen(plain, 1)
    fused = GPTModel(plain.config, 128, seed=3, kernels=KernelConfig(kernel_decode_attention="fused")).eval()
    fused.load_state_dict(plain.state_dict())
    calls = []
    real = decode_rotary.decode_rotary_attention
    monkeypatch.setattr(decode_rotary, "decode_rotary_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(max_new_tokens=8, logprobs=True)
    for prompt in PROMPTS:
        want = Engine(plain, VOCAB).generate([Request(prompt, params)])[0]
        got = Engine(fused, VOCAB).generate([Request(prompt, params)])[0]
        assert got.tokens == want.tokens
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    steps = len(PROMPTS) * 7 * plain.config.num_layers  # every decode step after the prefill, every layer
    assert len(calls) == steps
    calls.clear()
    Engine(fused, VOCAB).generate([Request(p, params) for p in PROMPTS[:2]])  # two rows: the unfused path
    assert not calls


def test_generate_command_takes_the_decode_switches(tmp_path, capsys, monkeypatch):
    """``paratron generate --kernel-decode-attention fused``: the model built with that switch (printed at start-up)
    gives the default path's tokens; a value outside the switch's choices is refused by argparse."""
    import json

    from paratron.cli import main
    from paratron.inference import load as load_module
    from tests.tiny_generation import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path)
    capsys.readouterr()  # (the conversion's lines)
    run = ["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "hello world", "--json", "--max-new-tokens", "6",
           "--ignore-eod"]
    assert main(run) == 0
    plain = capsys.readouterr()
    built = []
    real = load_module._model
    monkeypatch.setattr(load_module, "_model", lambda *a: built.append(a[-1]) or real(*a))
    assert main(run + ["--kernel-decode-attention", "fused"]) == 0
    fused = capsys.readouterr()
    assert json.loads(fused.out)["tokens"] == json.loads(plain.out)["tokens"]
    assert built[0].kernel_decode_attention == "fused" and "--kernel-decode-attention fused" in fused.err
    assert "--kernel-decode-attention auto" in plain.err
    assert main(run + ["--kernel-decode-attention", "flash"]) == 2
    assert "--kernel-decode-attention" in capsys.readouterr().err


def test_fused_splits_walk_at_most_384_slots_of_a_full_cache_without_overfilling_the_gpu():
    assert decode_rotary.fused_splits(8, 384, 132) == 1  # llama-1b's 8 groups, a 384-slot cache: unsplit
    assert decode_rotary.fused_splits(8, 2048, 132) == 6
    assert decode_rotary.fused_splits(8, 385, 132) == 2
    assert decode_rotary.fused_splits(100, 8192, 132) == 2  # at most two programs a multiprocessor
    assert decode_rotary.fused_splits(300, 8192, 132) == 1
