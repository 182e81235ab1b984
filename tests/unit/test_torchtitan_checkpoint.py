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
    (["--flavor", "gpt:8B"], r"torchtitan model 'gpt': paratron reads llama3, qwen3 and deepseek_v3"),
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


DEEPSEEK = DATA.parent / "deepseek_v3"
DEEPSEEK_ARGS = {"name": "deepseek_v3", "n_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                 "moe_args": {"num_shared_experts": 1, "top_k": 2, "score_func": "sigmoid", "route_norm": True,
                              "route_scale": 2.5, "num_expert_groups": 2, "num_limited_groups": 1,
                              "score_before_experts": False}}


def _deepseek(tmp_path, **moe) -> tuple:
    """``paratron convert --from torchtitan`` of the DeepSeek-V3 fixture (``moe``: router args changed)."""
    args = {**DEEPSEEK_ARGS, "moe_args": {**DEEPSEEK_ARGS["moe_args"], **moe}}
    code = C.main(["--from", "torchtitan", "--input", str(DEEPSEEK), "--save", str(tmp_path / "ds"), "--model-args",
                   json.dumps(args), "--seq-length", "64", "--quiet"])
    assert code == 0
    return C.read_checkpoint(tmp_path / "ds", log=lambda *a: None)


def test_deepseek_v3_gives_torchtitans_logits(tmp_path):
    """torchtitan's DeepSeek-V3 (MLA with q_lora_rank 32 and interleaved RoPE pairs, a dense first layer, then 4
    experts sigmoid-routed top-2 in 2 groups keeping 1, renormalised and scaled by 2.5, a shared expert, the
    expert bias of load_balance_coeff 1e-3 moved by 3 steps): torchtitan's logits. Its final norm has
    nn.RMSNorm's default eps (fp32's machine epsilon) where paratron's has --norm-epsilon (1e-5): 6e-6 of the
    largest logit; with that eps the logits agree to 1e-7."""
    cfg, vocab, it, state = _deepseek(tmp_path)
    m = cfg.model
    assert (it, vocab, m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.num_experts) == (3, 128, True, 32,
                                                                                                   32, 4)
    assert (m.moe_router_score_function, m.moe_router_topk, m.moe_router_topk_scaling_factor,
            m.moe_router_num_groups, m.moe_router_group_topk, m.moe_shared_expert_intermediate_size,
            m.moe_layer_freq, m.moe_router_bias_update_rate) == ("sigmoid", 2, 2.5, 2, 1, 32, "[0,1]", 1e-3)
    bias = json.loads((DEEPSEEK / "run.json").read_text())["steps"][2]["expert_bias_after_step"]["1"]
    assert torch.equal(state["decoder.layers.1.mlp.router.expert_bias"], torch.tensor(bias))
    ref = torch.load(DEEPSEEK / "reference_logits.pt", weights_only=True)
    model = GPTModel(m, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"]).float()[..., :128]
        assert (logits - ref["logits"]).abs().max() < 1e-5 * ref["logits"].abs().max()
        model.decoder.final_layernorm.eps = torch.finfo(torch.float32).eps
        logits = model(ref["tokens"]).float()[..., :128]
    assert (logits - ref["logits"]).abs().max() < 1e-6 * ref["logits"].abs().max()


def test_deepseek_v3_resume_continues_torchtitans_losses(tmp_path):
    """Adam's moments and step, the expert bias and its update rate come over: steps 4 to 6 give torchtitan's losses
    (its final-norm eps aside, above); without the optimizer state they differ."""
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_train import losses_of
    cfg = _deepseek(tmp_path)[0]
    common = json.loads(next((tmp_path / "ds").glob("iter_*/common.json")).read_text())
    assert common["optimizer"]["step"] == 3 and common["consumed_samples"] == 6
    want = [s["loss"] for s in json.loads((DEEPSEEK / "run.json").read_text())["steps"]][3:]
    runs = []
    for extra in ([], ["--no-load-optim"]):
        t = Trainer(parse_args(C.training_flags(cfg.model) + ["--load", str(tmp_path / "ds"), *FLAGS, *extra]))
        runs.append(losses_of(t, 3))
        t.close()
    assert all(abs(g - w) <= 1e-4 * w for g, w in zip(runs[0], want)), (runs[0], want)
    assert abs(runs[1][2] - want[2]) > 1e-3 * want[2], runs[1]


def test_deepseek_v3_flavors_and_yarn():
    """The flavors table gives the args the tensors do not; a training.seq_len above original_seq_len (4096) turns
    torchtitan's YaRN on: rope_factor, and its mscale as both of paratron's (unscaled cos / sin)."""
    from paratron.checkpoint import sharded
    from paratron.checkpoint.torchtitan_deepseek import deepseek_config
    args = T.model_args("deepseek_v3:671B", None)
    assert (args["n_heads"], args["moe_args"]["top_k"], args["moe_args"]["route_scale"]) == (128, 8, 2.5)
    shapes = {k: v[0] for k, v in sharded.tensor_shapes(T.step_dir(DEEPSEEK)).items()}
    args = T.model_args(None, {**DEEPSEEK_ARGS, "mscale": 0.7, "max_seq_len": 8192})
    cfg = deepseek_config(shapes, args)[0]
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 40.0, 0.7, 0.7)
    assert deepseek_config(shapes, {**args, "max_seq_len": 4096})[0].rope_type == "rope"


@pytest.mark.parametrize("argv,message", [
    (["--flavor", "deepseek_v3:16B", "--seq-length", "64"], r"DeepSeek-V3 checkpoint has score_func 'softmax'"),
    (["--model-args", json.dumps({**DEEPSEEK_ARGS, "moe_args": {**DEEPSEEK_ARGS["moe_args"], "route_norm": False}}),
      "--seq-length", "64"], r"has route_norm false with top_k 2 \(paratron normalises"),
    (["--model-args", json.dumps({**DEEPSEEK_ARGS, "moe_args": {**DEEPSEEK_ARGS["moe_args"],
                                                                "score_before_experts": True}}),
      "--seq-length", "64"], r"has score_before_experts true"),
    (["--model-args", json.dumps({**DEEPSEEK_ARGS, "moe_args": {**DEEPSEEK_ARGS["moe_args"], "top_k": 3}}),
      "--seq-length", "64"], r"num_expert_groups with top_k 3 / num_limited_groups 1 != 2"),
    (["--model-args", json.dumps({**DEEPSEEK_ARGS, "v_head_dim": 8}), "--seq-length", "64"],
     r"do not fit 4 heads of qk_nope_head_dim 16, qk_rope_head_dim 8 and v_head_dim 8"),
    (["--model-args", json.dumps(DEEPSEEK_ARGS)], r"--seq-length: torchtitan's DeepSeek-V3 turns YaRN on"),
])
def test_deepseek_v3_refusals_are_one_line(tmp_path, capsys, argv, message):
    code = C.main(["--from", "torchtitan", "--input", str(DEEPSEEK), "--save", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and re.search(message, err), err
