"""``paratron convert --from torchtitan``: checkpoints torchtitan 0.2.2 itself wrote (tests/data/torchtitan_ckpt: its
llama3 Transformer, AdamW, LR scheduler and CheckpointManager on a CPU, fp32, 3 steps on the samples paratron's
``--mock-data --split 1,1,1`` gives; run.json has torchtitan's losses of steps 1 to 6). Converted, the model computes
torchtitan's logits, and ``--load`` resumes the run with torchtitan's losses."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from paratron.checkpoint import convert as C
from paratron.checkpoint import torchtitan as T
from paratron.checkpoint.hf_config import ConversionError
from paratron.model.gpt import GPTModel

DATA = Path(__file__).resolve().parents[1] / "data" / "torchtitan_ckpt" / "llama3"
RUN = json.loads((DATA / "run.json").read_text())
ARGS = '{"n_heads": 4, "n_kv_heads": 2, "rope_theta": 10000, "norm_eps": 1e-6}'  # (a custom flavor)
# the training flags of torchtitan's run (its warm-up and cosine decay give the same LR at steps 4 to 6 as these)
FLAGS = ["--mock-data", "--split", "1,1,1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--min-lr",
         "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad",
         "1.0", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--num-workers", "0", "--eval-iters", "0", "--seed",
         "3", "--log-interval", "1"]


def converted(tmp_path, step: int = 3) -> tuple:
    """``paratron convert --from torchtitan`` of step ``step`` into tmp_path/ckpt; read back (config, vocabulary,
    iteration, model state)."""
    code = C.main(["--from", "torchtitan", "--input", str(DATA), "--iteration", str(step), "--save",
                   str(tmp_path / "ckpt"), "--model-args", ARGS, "--seq-length", "64", "--quiet"])
    assert code == 0
    return C.read_checkpoint(tmp_path / "ckpt", log=lambda *a: None)


def model_flags(tmp_path) -> list[str]:
    cfg = C.read_checkpoint(tmp_path / "ckpt", log=lambda *a: None)[0]
    return [f for f in C.training_flags(cfg.model) if f != "--finetune"]


def test_converted_model_gives_torchtitans_logits(tmp_path):
    """Llama-3.1 RoPE scaling (torchtitan's default) and its interleaved RoPE pairs, permuted to rotate-half."""
    ref = torch.load(DATA / "reference_logits.pt", weights_only=True)
    cfg, vocab, it, state = converted(tmp_path)
    assert (it, vocab, cfg.model.use_rope_scaling, cfg.model.rope_scaling_factor) == (3, 128, True, 8.0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"]).float()[..., :128]
    assert (logits - ref["logits"]).abs().max() < 1e-5 * ref["logits"].abs().max()


def _losses(tmp_path, *extra) -> list[float]:
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_train import losses_of
    t = Trainer(parse_args(model_flags(tmp_path) + ["--load", str(tmp_path / "ckpt"), *FLAGS, *extra]))
    assert (t.iteration, t.consumed_samples) == (3, 6)
    got = losses_of(t, 3)
    t.close()
    return got


def test_resumed_run_continues_torchtitans_losses(tmp_path):
    """Adam's moments and step, the iteration and the samples seen come over: steps 4 to 6 give torchtitan's losses
    (torchtitan also decays the norms' weights, paratron as Megatron does not: 2e-5 here); without the optimizer
    state they differ by 8e-3 and more."""
    converted(tmp_path)
    want = [s["loss"] for s in RUN["steps"]][3:]
    got = _losses(tmp_path)
    assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (got, want)
    fresh = _losses(tmp_path, "--no-load-optim")
    assert abs(fresh[2] - want[2]) > 1e-3 * want[2], fresh


def test_model_only_save_converts_the_weights(tmp_path):
    """torchtitan's final model-only export (step-6) has no optimizer state: iteration 0, weights only."""
    cfg, vocab, it, state = converted(tmp_path, step=6)
    common = json.loads(next((tmp_path / "ckpt").glob("iter_*/common.json")).read_text())
    assert it == 0 and common["optimizer"] is None and common["converted_from"]["step"] == 6
    assert set(state) == set(GPTModel(cfg.model, cfg.padded_vocab_size, device="meta").state_dict())


def test_rope_pairs_become_halves():
    w = torch.arange(16.0).reshape(8, 2)  # 2 heads of head_dim 4: rows (pair 0: 0, 1; pair 1: 2, 3) per head
    assert T._rotate_half_rows(w, 2)[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


@pytest.mark.parametrize("argv,message", [
    ([], r"needs the model's flavor: --flavor \[NAME:\]FLAVOR"),
    (["--flavor", "9B"], r"--flavor '9B': torchtitan's flavors are llama3:debugmodel"),
    (["--flavor", "gpt:8B"], r"torchtitan model 'gpt': paratron reads llama3 and qwen3"),
    (["--model-args", "{n_heads: 4}"], r"--model-args is not JSON"),
    (["--model-args", '{"n_heads": 8, "n_kv_heads": 2}'], r"do not fit 8 heads and 2 KV heads"),
    (["--model-args", '{"n_heads": 4, "window": 2}'], r"--model-args: window is not a field paratron reads"),
    (["--model-args", ARGS, "--iteration", "3"], r"--seq-length: torchtitan.s training.seq_len is needed"),
    (["--model-args", ARGS, "--seq-length", "64", "--dtype", "bf16"], r"--dtype does not apply to --from torchtitan"),
])
def test_refusals_are_one_line(tmp_path, capsys, argv, message):
    code = C.main(["--from", "torchtitan", "--input", str(DATA), "--save", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and re.search(message, err), err
    with pytest.raises(ConversionError, match="no torchtitan checkpoint"):
        T.step_dir(tmp_path)


QWEN3 = DATA.parent / "qwen3_moe"
QWEN3_ARGS = ('{"name": "qwen3", "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "rope_theta": 10000, "norm_eps": 1e-6, '
              '"moe_args": {"num_shared_experts": 0, "top_k": 2, "score_func": "softmax", "route_norm": true, '
              '"score_before_experts": false}}')


def test_qwen3_moe_converts_and_resumes(tmp_path):
    """torchtitan's Qwen3 MoE (q/k norms, rotate-half RoPE, 4 experts top-2 renormalised, stacked experts
    [experts, out, in]): torchtitan's logits, and its losses of steps 4 to 6 after the resume."""
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_train import losses_of
    code = C.main(["--from", "torchtitan", "--input", str(QWEN3), "--save", str(tmp_path / "q"), "--model-args",
                   QWEN3_ARGS, "--seq-length", "64", "--quiet"])
    cfg, _, it, state = C.read_checkpoint(tmp_path / "q", log=lambda *a: None)
    assert (code, it, cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.qk_layernorm) == (0, 3, 4, 2, True)
    ref = torch.load(QWEN3 / "reference_logits.pt", weights_only=True)
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"]).float()[..., :128]
    assert (logits - ref["logits"]).abs().max() < 1e-5 * ref["logits"].abs().max()
    t = Trainer(parse_args(C.training_flags(cfg.model) + ["--load", str(tmp_path / "q"), *FLAGS]))
    got = losses_of(t, 3)
    t.close()
    want = [s["loss"] for s in json.loads((QWEN3 / "run.json").read_text())["steps"]][3:]
    assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (got, want)


def test_a_trained_expert_bias_is_refused():
    T._no_expert_bias({"layers.0.moe.expert_bias": torch.zeros(4)})  # torchtitan's Qwen3 leaves it at 0: dropped
    with pytest.raises(ConversionError, match=r"layers.0.moe.expert_bias is not zero: auxiliary-loss-free"):
        T._no_expert_bias({"layers.0.moe.expert_bias": torch.tensor([0.0, 1e-3, 0.0, 0.0])})


def test_load_of_a_torchtitan_folder_names_the_conversion():
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    with pytest.raises(Exception, match=r"holds torchtitan's checkpoint step-6: convert it first, then --load the "
                                        r"result: paratron convert --from torchtitan --input"):
        Trainer(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--load",
                            str(DATA), *FLAGS]))
