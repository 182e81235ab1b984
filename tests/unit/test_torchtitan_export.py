"""``paratron convert --to torchtitan``: a torchtitan 0.2.2 checkpoint (tests/data/torchtitan_ckpt, written by
torchtitan's own CheckpointManager) converted to paratron and written back is the same checkpoint: every tensor
(model, AdamW's moments and step) and every object (param groups, LR scheduler, train state) but the data loader's,
under the same DCP names and paths. (torchtitan itself resuming such an export and reproducing its losses is checked
outside the repository: /work/tt_fixtures/validate_export.py.)"""
from __future__ import annotations

import json
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from paratron.checkpoint import convert as C
from paratron.checkpoint import sharded
from paratron.checkpoint import to_torchtitan as X
from paratron.checkpoint import torchtitan as T
from paratron.checkpoint.pieces import SafeReader, read_objects
from tests.unit.test_torchtitan_checkpoint import ARGS, DATA, DEEPSEEK, DEEPSEEK_ARGS, FLAGS, QWEN3, QWEN3_ARGS, RUN

QWEN3_NO_BIAS = json.dumps({**json.loads(QWEN3_ARGS), "moe_args": {**json.loads(QWEN3_ARGS)["moe_args"],
                                                                   "load_balance_coeff": None}})


def _convert(src, save, args, step=3) -> None:
    assert C.main(["--from", "torchtitan", "--input", str(src), "--iteration", str(step), "--save", str(save),
                   "--model-args", args, "--seq-length", "64", "--quiet"]) == 0


@pytest.fixture(scope="module")
def paratron_ckpts(tmp_path_factory):
    """The llama3, qwen3_moe and deepseek_v3 fixtures' step-3, converted to paratron checkpoints."""
    root = tmp_path_factory.mktemp("from_tt")
    _convert(DATA, root / "llama3", ARGS)
    _convert(QWEN3, root / "qwen3_moe", QWEN3_NO_BIAS)
    _convert(DEEPSEEK, root / "deepseek_v3", json.dumps(DEEPSEEK_ARGS))
    return root


def _export(load, out, args, *extra) -> int:
    return C.main(["--to", "torchtitan", "--load", str(load), "--output", str(out), "--model-args", args, "--quiet",
                   *extra])


def _entries(d) -> tuple[dict, dict]:
    """({tensor name: tensor}, {object name: object}) of a DCP directory, and its planner data."""
    md = SafeReader(str(d)).read_metadata()
    names = [k for k in md.state_dict_metadata if not k.startswith("dataloader.")]
    objects = [k for k in names if isinstance(md.state_dict_metadata[k], BytesStorageMetadata)]
    tensors = sharded.load_full(d, [k for k in names if k not in objects])
    return {**tensors, **read_objects(d, objects)}, {k: md.planner_data[k] for k in names}


@pytest.mark.parametrize("name,src,args", [("llama3", DATA, ARGS), ("qwen3_moe", QWEN3, QWEN3_NO_BIAS),
                                           ("deepseek_v3", DEEPSEEK, json.dumps(DEEPSEEK_ARGS))],
                         ids=["llama3", "qwen3_moe", "deepseek_v3"])
def test_round_trip_writes_torchtitans_checkpoint_back(paratron_ckpts, tmp_path, name, src, args):
    """Llama-3's wq / wk rows interleaved again, the experts stacked again, DeepSeek-V3's MLA and its trained expert
    bias: names, shapes, dtypes, values, Adam's step, the param groups, LambdaLR's state and the train state all equal
    the fixture's (the data loader's aside)."""
    assert _export(paratron_ckpts / name, tmp_path / "tt", args) == 0
    want, want_paths = _entries(src / "checkpoint" / "step-3")
    got, got_paths = _entries(tmp_path / "tt" / "checkpoint" / "step-3")
    assert sorted(got) == sorted(want) and got_paths == want_paths
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            assert got[k].dtype == w.dtype and torch.equal(got[k], w), k
        else:
            assert type(got[k]) is type(w) and got[k] == w, k
    assert (got["train_state.step"], got["train_state.ntokens_seen"], got["lr_scheduler.last_epoch"]) == (3, 384, 3)
    assert got["optimizer.state.norm.weight.step"].item() == 3.0


def test_rope_rows_interleave_back():
    w = torch.randn(32, 8)
    assert torch.equal(X._interleave_rows(T._rotate_half_rows(w, 2), 2), w)
    assert X._interleave_rows(torch.arange(8.0).reshape(8, 1), 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_qwen3_flavor_load_balancing_gets_a_zero_expert_bias(paratron_ckpts, tmp_path):
    """torchtitan's qwen3 MoE flavors keep load_balance_coeff 1e-3: their model has an expert_bias buffer, which its
    loader asks for (zeros: its Qwen3 training never moves it)."""
    assert _export(paratron_ckpts / "qwen3_moe", tmp_path / "tt", QWEN3_ARGS) == 0
    d = tmp_path / "tt" / "checkpoint" / "step-3"
    bias = sharded.load_full(d, ["layers.0.moe.expert_bias", "layers.1.moe.expert_bias"])
    assert all(torch.equal(b, torch.zeros(4)) for b in bias.values())
    assert "optimizer.state.layers.0.moe.expert_bias.exp_avg" not in sharded.tensor_shapes(d)


def test_a_paratron_schedule_gives_the_next_lr_and_tokens():
    """A checkpoint paratron trained: its schedule's LR now (the next step's) in the param groups and LambdaLR's
    _last_lr, its peak as torchtitan's base LR, last_epoch the iteration, the samples seen x seq_length as tokens;
    these flags' schedule is torchtitan's run's (run.json: the LR of step 5)."""
    from paratron.optim.schedule import build_scheduler
    from paratron.train.resolve import parse_args
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                      "--max-position-embeddings", "64", *FLAGS])
    sched = build_scheduler(cfg, 12)
    sched.num_steps = 8
    group, lam, train = X.run_state(cfg, {"scheduler": sched.state_dict(), "consumed_samples": 8}, 4)
    assert group["lr"] == pytest.approx(RUN["steps"][4]["lr"], rel=1e-12) and lam["_last_lr"] == [group["lr"]]
    assert (group["initial_lr"], group["betas"], group["eps"], group["weight_decay"], group["fused"]) == (
        1e-3, (0.9, 0.95), 1e-8, 0.1, True)
    assert (lam["base_lrs"], lam["last_epoch"], lam["_step_count"], train) == (
        [1e-3], 4, 5, {"step": 4, "ntokens_seen": 512})


def test_a_model_only_checkpoint_is_written_as_step_0(tmp_path):
    """torchtitan's model-only export (step-6) -> paratron (weights only) -> torchtitan's step-0, which its
    CheckpointManager loads as model weights only."""
    _convert(DATA, tmp_path / "p", ARGS, step=6)
    assert _export(tmp_path / "p", tmp_path / "tt", ARGS) == 0
    got, _ = _entries(tmp_path / "tt" / "checkpoint" / "step-0")
    want, _ = _entries(DATA / "checkpoint" / "step-6")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], w) for k, w in want.items())


@pytest.mark.parametrize("argv,message", [
    (["--model-args", ARGS, "--seq-length", "64"], r"--seq-length does not apply to --to torchtitan"),
    ([], r"--to torchtitan needs the torchtitan run's flavor: --flavor \[NAME:\]FLAVOR"),
    (["--flavor", "llama3:debugmodel"], r"--flavor llama3:debugmodel is not this paratron model: dim 256 \(flavor\) "
                                        r"vs 64 \(checkpoint\), n_layers 6 \(flavor\) vs 2 \(checkpoint\), vocab_size "
                                        r"2048 \(flavor\) vs 128"),
    (["--model-args", ARGS[:-1] + ', "vocab_size": 127}'], r"vocab_size 127 \(flavor\) vs 128 \(checkpoint\)"),
    (["--model-args", ARGS.replace("10000", "500000")], r"rotary_base 500000.0 \(flavor\) vs 10000.0 \(checkpoint\)"),
    (["--model-args", ARGS[:-1] + ', "rope_scaling_args": {"scaling_factor": 1.0}}'],
     r"use_rope_scaling False \(flavor\) vs True \(checkpoint\)"),
    (["--model-args", '{"name": "qwen3", "n_heads": 4, "n_kv_heads": 2, "head_dim": 16}'],
     r"torchtitan's qwen3 cannot express this paratron model: it has no q/k norms \(torchtitan's Qwen3 has them"),
    (["--flavor", "deepseek_v3:671B"], r"torchtitan's deepseek_v3 cannot express this paratron model: it has no "
                                       r"multi-latent attention"),
    (["--flavor", "gpt_oss:20b"], r"torchtitan model 'gpt_oss': paratron reads llama3, qwen3 and deepseek_v3"),
    (["--model-args", ARGS, "--family", "llama"], r"--family does not apply to --to torchtitan"),
])
def test_refusals_are_one_line(paratron_ckpts, tmp_path, capsys, argv, message):
    code = C.main(["--to", "torchtitan", "--load", str(paratron_ckpts / "llama3"), "--output", str(tmp_path / "x"),
                   *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and re.search(message, err), err
    assert not (tmp_path / "x").exists()


def test_llama3_cannot_hold_qwen3s_model_and_output_is_not_replaced(paratron_ckpts, tmp_path, capsys):
    assert _export(paratron_ckpts / "qwen3_moe", tmp_path / "x", ARGS) == 2
    assert "torchtitan's llama3 cannot express this paratron model: it has q/k norms" in capsys.readouterr().err
    assert _export(paratron_ckpts / "llama3", tmp_path / "tt", ARGS) == 0
    assert _export(paratron_ckpts / "llama3", tmp_path / "tt", ARGS) == 2
    assert "already holds a torchtitan checkpoint folder (checkpoint); pass --force" in capsys.readouterr().err
    assert _export(paratron_ckpts / "llama3", tmp_path / "tt", ARGS, "--force") == 0
    assert sorted(p.name for p in (tmp_path / "tt" / "checkpoint").iterdir()) == ["step-3"]
    assert C.main(["--to", "torchtitan", "--load", str(paratron_ckpts / "llama3"), "--model-args", ARGS]) == 2
    assert "--to torchtitan needs --load CKPT_DIR and --output" in capsys.readouterr().err


TIED_ARGS = {"name": "qwen3", "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "rope_theta": 10000, "norm_eps": 1e-6,
             "enable_weight_tying": True, "vocab_size": 100}


def _tied_qwen3(root) -> dict:
    """A paratron checkpoint of a tied Qwen3 (vocabulary 100 padded to 128 rows) at iteration 4 with Adam's state:
    its tensors."""
    from paratron.checkpoint.hf_config import model_config_from_hf
    from paratron.checkpoint.state import layout
    from paratron.model.gpt import GPTModel
    from paratron.optim.schedule import build_scheduler
    from paratron.parallel.dims import ParallelDims
    from paratron.train.resolve import parse_args
    m = model_config_from_hf({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "intermediate_size": 96, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                              "tie_word_embeddings": True})[0]
    flags = [f if f != "127" else "100" for f in FLAGS]
    cfg = parse_args(C.training_flags(m) + ["--seq-length", "64", *flags])
    torch.manual_seed(0)
    model = {f"model.{k}": v for k, v in GPTModel(cfg.model, cfg.padded_vocab_size).state_dict().items()}
    tensors = {**model, **{f"optimizer.{s}.{k[6:]}": torch.rand_like(v) for s in ("exp_avg", "exp_avg_sq")
                           for k, v in model.items()}}
    sched = build_scheduler(cfg, 12)
    sched.num_steps = 8
    common = {"consumed_samples": 8, "skipped_iterations": 0, "scheduler": sched.state_dict(), "rng": False,
              "optimizer": {"step": 4, "scaler": {"scale": 1.0}}, "layout": layout(ParallelDims(), None),
              "config": cfg.to_dict()}
    sharded.save_full(root, 4, tensors, common)
    return tensors


def test_tied_qwen3_names_the_embedding_twice_and_reads_back(tmp_path):
    """torchtitan's tied Qwen3 (enable_weight_tying) saves the shared weight as tok_embeddings.weight and output.weight,
    its optimizer state once; the vocabulary's padding rows are dropped; --from torchtitan reads it back."""
    src = _tied_qwen3(tmp_path / "p")
    assert _export(tmp_path / "p", tmp_path / "tt", json.dumps(TIED_ARGS)) == 0
    d = tmp_path / "tt" / "checkpoint" / "step-4"
    got, _ = _entries(d)
    emb = src["model.embedding.word_embeddings.weight"]
    assert torch.equal(got["output.weight"], emb[:100]) and torch.equal(got["tok_embeddings.weight"], emb[:100])
    assert not any(k.startswith(("optimizer.state.output.", "optimizer.param_groups.output.")) for k in got)
    assert torch.equal(got["optimizer.state.tok_embeddings.weight.exp_avg"],
                       src["optimizer.exp_avg.embedding.word_embeddings.weight"][:100])
    assert (got["train_state.ntokens_seen"], got["lr_scheduler.last_epoch"]) == (512, 4)
    _convert(tmp_path / "tt", tmp_path / "back", json.dumps(TIED_ARGS), step=4)
    back = sharded.load_full(next((tmp_path / "back").glob("iter_*")))
    assert sorted(back) == sorted(src)
    for k, v in src.items():  # (the reader keeps the 100 rows: its vocabulary, unpadded)
        assert torch.equal(back[k], v[:100] if "word_embeddings" in k else v), k
    untied = json.dumps({**TIED_ARGS, "enable_weight_tying": False})
    assert _export(tmp_path / "p", tmp_path / "x", untied) == 2


@pytest.mark.parametrize("moe,message", [
    ({"load_balance_coeff": None}, r"load_balance_coeff 0.0 \(flavor\) vs 0.001 \(checkpoint\)"),
    ({"route_scale": 1.0}, r"moe_router_topk_scaling_factor 1.0 \(flavor\) vs 2.5 \(checkpoint\)"),
    ({"score_func": "softmax"}, r"score_func 'softmax'"),
])
def test_deepseek_v3_refusals(paratron_ckpts, tmp_path, capsys, moe, message):
    args = {**DEEPSEEK_ARGS, "moe_args": {**DEEPSEEK_ARGS["moe_args"], **moe}}
    assert _export(paratron_ckpts / "deepseek_v3", tmp_path / "x", json.dumps(args)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert _export(paratron_ckpts / "deepseek_v3", tmp_path / "x", ARGS) == 2
    assert "torchtitan's llama3 cannot express this paratron model: it has multi-latent attention" in (
        capsys.readouterr().err)


def test_llama3_debugmodel_flavor(tmp_path, capsys):
    """A paratron model of torchtitan's own llama3:debugmodel flavor (dim 256, 6 layers, 16 heads, vocabulary 2048,
    RoPE base 5e5 with Llama-3.1's scaling, FFN 768) passes --flavor llama3:debugmodel as is; without the scaling it
    is refused. (torchtitan's debugmodel Transformer loading such an export gives paratron's logits within 8e-7
    relative: /work/tt_fixtures.)"""
    from paratron.checkpoint.state import layout
    from paratron.model.gpt import GPTModel
    from paratron.parallel.dims import ParallelDims
    from paratron.train.resolve import parse_args
    flags = ["--num-layers", "6", "--hidden-size", "256", "--ffn-hidden-size", "768", "--num-attention-heads", "16",
             "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
             "--rotary-base", "500000", "--use-rope-scaling", "--normalization", "RMSNorm", "--swiglu",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "2048", "--mock-data", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3"]
    for name, argv in (("ok", flags), ("plain_rope", [f for f in flags if f != "--use-rope-scaling"])):
        cfg = parse_args(argv)
        state = GPTModel(cfg.model, cfg.padded_vocab_size, device="meta").state_dict()
        common = {"consumed_samples": 0, "optimizer": None, "scheduler": None, "rng": False,
                  "layout": layout(ParallelDims(), None), "config": cfg.to_dict()}
        sharded.save_full(tmp_path / name, 0, {f"model.{k}": torch.zeros(v.shape) for k, v in state.items()}, common)
    assert C.main(["--to", "torchtitan", "--load", str(tmp_path / "ok"), "--output", str(tmp_path / "tt"), "--flavor",
                   "llama3:debugmodel", "--quiet"]) == 0
    shapes = sharded.tensor_shapes(tmp_path / "tt" / "checkpoint" / "step-0")
    assert len(shapes) == 3 + 6 * 9 and shapes["tok_embeddings.weight"][0] == (2048, 256)
    assert shapes["layers.5.feed_forward.w1.weight"][0] == (768, 256)
    assert C.main(["--to", "torchtitan", "--load", str(tmp_path / "plain_rope"), "--output", str(tmp_path / "x"),
                   "--flavor", "debugmodel"]) == 2
    assert "--flavor debugmodel is not this paratron model: use_rope_scaling True (flavor) vs False" in (
        capsys.readouterr().err)
