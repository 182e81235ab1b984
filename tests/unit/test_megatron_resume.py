"""``--load MEGATRON_DIR`` without ``--finetune``: resuming Megatron-LM's own torch_dist checkpoints with their
optimizer state. The checkpoints in tests/data/megatron_ckpt/optim were saved by Megatron-LM (megatron-core 0.16.1) after 3
iterations on the mock data paratron reads with ``--mock-data --split 1,1,1``; losses.json holds the losses of
Megatron's uninterrupted run (iterations 1..6). paratron resumed at iteration 3 must continue with Megatron's losses:
the optimizer's moments, Adam's step, the LR schedule's position and the consumed samples all enter them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratron.checkpoint import megatron_buckets as B
from paratron.checkpoint.pieces import CheckpointError

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron_ckpt" / "optim"
WANT = json.loads((DATA / "losses.json").read_text())
# the training flags of Megatron's run, and the data paratron reads as Megatron's mock samples
FLAGS = ["--use-checkpoint-args", "--mock-data", "--split", "1,1,1", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "127", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "6", "--lr", "1e-3",
         "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1",
         "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--num-workers",
         "0", "--eval-iters", "0", "--seed", "3", "--log-interval", "1"]
# case -> (this run's extra flags, tolerance on the loss): fp32 cases continue to float32 rounding; bf16 ones to the
# difference of two bf16 forwards (the loss moves by 0.28 from step 4 to 5 when the moments are not loaded)
CASES = {"distopt_dp2": ([], 2e-6), "moe_distopt_ep2_full": (["--moe-aux-loss-coeff", "0"], 2e-6),
         "plain_tp2_bf16": (["--bf16"], 1e-2), "moe_mixed_shared": (["--moe-aux-loss-coeff", "0"], 2e-6),
         "mla": ([], 2e-6), "hybrid_distopt_dp2_full": ([], 2e-6),
         "legacy_plain_tp2": ([], 2e-6), "legacy_plain_tp2_bf16": (["--bf16"], 1e-2),
         "legacy_distopt_dp2": ([], 2e-6), "legacy_plain_pp2": ([], 2e-6)}
# (tests/parallel/test_megatron_resume.py reads these too, and distopt_pp2, moe_distopt_ep2, distopt_pp2_vpp2_dp2)
EXTRA = {"moe_distopt_ep2": ["--moe-aux-loss-coeff", "0"]}


def trainer(case: str, *extra):
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    return Trainer(parse_args(["--load", str(DATA / case), *FLAGS, *CASES.get(case, ([], 0))[0], *extra]))


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_megatron_checkpoint_continues_megatrons_run(case):
    """distopt_dp2: the distributed optimizer's default dp_reshardable buckets (saved at DP 2, read at DP 1);
    moe_distopt_ep2_full: fully_reshardable per-parameter state of a MoE (EP 2, experts stacked here);
    plain_tp2_bf16: the plain optimizer at TP 2 with bf16 weights and fp32 mains; moe_mixed_shared: a dense and an MoE
    layer with a shared expert (Megatron's per-layer names); mla: multi-latent attention (its own norm names);
    hybrid_distopt_dp2_full: a Mamba-2 hybrid (M*M-), fully_reshardable state in torch_dist's in_proj / conv1d
    blocks (megatron_hybrid.py); legacy_*: Megatron's legacy format (--ckpt-format torch, megatron_legacy_state.py):
    the plain optimizer's Adam state by parameter index at TP 2 (fp32; bf16 with its fp32 main weights) and at PP 2,
    read at TP 1 / PP 1; the distributed optimizer's distrib_optim.pt saved at DP 2, read at DP 1."""
    from tests.unit.test_train import losses_of
    t = trainer(case)
    assert (t.iteration, t.consumed_samples, t.scheduler.num_steps) == (3, 6, 6)
    got = losses_of(t, 3)
    t.close()
    want, tol = WANT[case]["lm_loss"][3:], CASES[case][1]
    assert all(abs(g - w) <= tol * abs(w) for g, w in zip(got, want)), (got, want)


def test_without_the_optimizer_state_the_losses_differ():
    """The control of the test above: the same resume with fresh moments (--no-load-optim, which also restarts the
    LR schedule, as in Megatron) leaves Megatron's losses."""
    from tests.unit.test_train import losses_of
    t = trainer("distopt_dp2", "--no-load-optim")
    got = losses_of(t, 3)
    t.close()
    assert abs(got[1] - WANT["distopt_dp2"]["lm_loss"][4]) > 0.1, got


def test_without_the_legacy_optimizer_state_the_losses_differ():
    """The same control for the legacy format: --no-load-optim leaves Megatron's losses."""
    from tests.unit.test_train import losses_of
    t = trainer("legacy_plain_tp2", "--no-load-optim")
    assert (t.iteration, t.consumed_samples) == (3, 6)
    got = losses_of(t, 3)
    t.close()
    assert abs(got[1] - WANT["legacy_plain_tp2"]["lm_loss"][4]) > 0.1, got


def _edited_legacy(tmp_path, case: str, edit) -> Path:
    """A copy of legacy checkpoint ``case`` whose rank files ``edit(state)`` changed (args as plain values)."""
    import argparse
    import shutil
    from paratron.checkpoint.megatron import _torch_load
    shutil.copytree(DATA / case, tmp_path / "mlm")
    for f in sorted((tmp_path / "mlm").glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = _torch_load(f)
        args = vars(state["args"])
        state["args"] = argparse.Namespace(**{k: v if isinstance(v, (int, float, str, bool, list, tuple, type(None)))
                                              else None for k, v in args.items()})
        edit(state)
        torch.save(state, f)
    return tmp_path / "mlm"


def _swap_layers(state):
    """The optimizer's entries of the two layers' QKV weights (same shape) exchanged, their fp32 main weights with
    them: the optimizer's order is not the model's."""
    params, mains = state["optimizer"]["optimizer"]["param_groups"][0]["params"], state["optimizer"][
        "fp32_from_fp16_params"][0]
    params[2], params[6] = params[6], params[2]
    mains[2], mains[6] = mains[6], mains[2]


def _vpp(state):
    state["model0"], state["model1"] = state.pop("model"), {}


def _groups(state):
    state["optimizer"]["param_groups"].append({**state["optimizer"]["param_groups"][1], "params": [], "wd_mult": 0.5})


_RESAVE = r".*re-save it from Megatron as torch_dist \(--ckpt-convert-format torch_dist\), or resume with --no-load-"


@pytest.mark.parametrize("case,edit,match", [
    ("legacy_plain_tp2_bf16", _swap_layers,
     r"fp32 main weights of Megatron's optimizer are not those of the model's" + _RESAVE),
    ("legacy_plain_tp2", _vpp, r"does not read the state of a virtual pipeline .* from Megatron's legacy" + _RESAVE),
    ("legacy_plain_tp2", lambda s: setattr(s["args"], "num_experts", 4), r"does not read an MoE's chained" + _RESAVE),
    ("legacy_plain_tp2", _groups, r"param groups \(wd_mult \[1.0, 0.0, 0.5\]\) are not the standard" + _RESAVE),
    ("legacy_plain_tp2", lambda s: s.pop("optimizer"), r"holds no optimizer state \(saved with --no-save-optim\?\)"),
], ids=["wrong-order", "virtual-pipeline", "moe", "param-groups", "no-optimizer"])
def test_legacy_layouts_not_read_are_refused_by_name(tmp_path, case, edit, match):
    """What the legacy reader does not take stops with one line naming it (and, for a layout, the fix): an optimizer
    order that is not the model's (caught by the fp32 main weights), a virtual pipeline, an MoE, other param groups,
    a checkpoint saved without optimizer state."""
    with pytest.raises(CheckpointError, match=match):
        trainer_at(_edited_legacy(tmp_path, case, edit), *CASES[case][0])


def test_legacy_distributed_optimizer_state_is_read_only_at_its_layout():
    """distrib_optim.pt holds one tensor and pipeline rank's buckets: read at that layout only (as torch_dist's
    dp_reshardable); resumed at PP 2 by tests/parallel/test_megatron_resume.py."""
    with pytest.raises(CheckpointError, match=r"read only at the layout it was saved with: "
                                              r"--pipeline-model-parallel-size 1 here, 2 in the checkpoint"):
        trainer("legacy_distopt_pp2")


def trainer_at(root: Path, *extra):
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    return Trainer(parse_args(["--load", str(root), *FLAGS, *extra]))


def test_a_wrongly_derived_bucket_layout_is_refused(monkeypatch):
    """The layout of the buckets is derived (Megatron does not save it); were paratron's order not Megatron's (here:
    the attention block's order not swapped), the main weights read back differ from the model's: refused."""
    monkeypatch.setattr(B, "_order_key", lambda rest, te: 0)
    with pytest.raises(CheckpointError, match=r"not laid out as paratron derives it for this model \(\d+ shards "
                                              r"differ from the model weights\); re-save it from Megatron with "
                                              r"--dist-ckpt-optim-fully-reshardable"):
        trainer("distopt_dp2")


def test_dp_reshardable_state_is_read_only_at_its_tensor_and_pipeline_layout():
    with pytest.raises(CheckpointError, match=r"read only at the layout it was saved with: "
                                              r"--tensor-model-parallel-size 1 here, 2 in the checkpoint"):
        trainer("distopt_tp2_dp2_bf16", "--bf16")


def _span(n: int) -> B._Span:
    return B._Span(torch.nn.Parameter(torch.zeros(n)), 0, n)


def test_bucket_placement_by_hand():
    """Reversed order, each start a multiple of 64, a bucket ending where a parameter ends; before a shared embedding
    Megatron closes the bucket at the next aligned start."""
    a, b, c, d = _span(100), _span(10), _span(64), _span(30)
    order = [("d", d), ("c", c), ("b", b), ("a", a)]  # laid out a, b, c | d
    placed = B.place(order, [("k0", 256), ("k1", 30)])  # a at 0, b at 128 (not 100), c at 192 (not 138), d
    assert [(s.numel, name, at) for s, name, at in placed] == [(100, "k0", 0), (10, "k0", 128), (64, "k0", 192),
                                                               (30, "k1", 0)]
    placed = B.place([("c", c), ("b", b), ("a", a)], [("k0", 138), ("k1", 64)])
    assert [(s.numel, name, at) for s, name, at in placed] == [(100, "k0", 0), (10, "k0", 128), (64, "k1", 0)]
    placed = B.place([("e", _span(64)), ("a", a)], [("k0", 128), ("k1", 64)])  # (the shared embedding's own bucket)
    assert [(name, at) for _, name, at in placed] == [("k0", 0), ("k1", 0)]
    with pytest.raises(CheckpointError, match="does not lay out as this model's parameters"):
        B.place([("b", b), ("a", a)], [("k0", 100)])
    with pytest.raises(CheckpointError, match="holds more than this model's parameters"):
        B.place([("a", a)], [("k0", 100), ("k1", 64)])


def test_megatron_order_of_a_layer_and_stacked_experts():
    """Megatron Core's registration order: the attention block's output projection before its QKV projection (under
    Transformer Engine's spec the input norm is fused into QKV, registered before its weight); SequentialMLP's experts
    one after the other, the grouped linear's all fc1 then all fc2; names outside a layer keep paratron's order."""
    shapes = {"input_layernorm.weight": (4,), "self_attention.linear_qkv.weight": (6, 4),
              "self_attention.linear_proj.weight": (4, 2), "pre_mlp_layernorm.weight": (4,),
              "mlp.experts.linear_fc1.weight": (2, 3, 4), "mlp.experts.linear_fc2.weight": (2, 4, 1)}
    named = [("embedding.word_embeddings.weight", torch.nn.Parameter(torch.zeros(8, 4)))]
    named += [(f"decoder.layers.0.{n}", torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]
    seq = [(n[len("decoder.layers.0."):] if n.startswith("decoder.") else n, s.first, s.numel)
           for n, s in B.megatron_params(named, grouped_experts=False)]
    assert seq == [("embedding.word_embeddings.weight", 0, 32), ("input_layernorm.weight", 0, 4),
                   ("self_attention.linear_proj.weight", 0, 8), ("self_attention.linear_qkv.weight", 0, 24),
                   ("pre_mlp_layernorm.weight", 0, 4),
                   ("mlp.experts.local_experts.0.linear_fc1.weight", 0, 12),
                   ("mlp.experts.local_experts.0.linear_fc2.weight", 0, 4),
                   ("mlp.experts.local_experts.1.linear_fc1.weight", 12, 12),
                   ("mlp.experts.local_experts.1.linear_fc2.weight", 4, 4)]
    te = [n[len("decoder.layers.0."):] for n, _ in B.megatron_params(named, grouped_experts=True, te=True)][1:]
    assert te == ["self_attention.linear_proj.weight", "input_layernorm.weight", "self_attention.linear_qkv.weight",
                  "pre_mlp_layernorm.weight", "mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc1.weight1",
                  "mlp.experts.linear_fc2.weight0", "mlp.experts.linear_fc2.weight1"]


def test_older_chained_optimizer_prefixes_resume_the_same(tmp_path):
    """Megatron before chained_optim_avoid_prefix saved a MoE's per-parameter state under ``chained_0.`` (dense) and
    ``chained_1.`` (experts): the same checkpoint so renamed resumes to the same losses."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from paratron.checkpoint import sharded
    from tests.unit.test_train import losses_of
    src = DATA / "moe_distopt_ep2_full" / "iter_0000003"
    tensors = sharded.load_full(src)
    renamed = {(f"chained_{int('.mlp.experts.' in k)}.{k}" if k.startswith("optimizer.state.") else k): v
               for k, v in tensors.items()}
    assert any(k.startswith("chained_1.") for k in renamed) and any(k.startswith("chained_0.") for k in renamed)
    dst = tmp_path / "mlm" / "iter_0000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(renamed, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(src / name, dst / name)
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("3")
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    t = Trainer(parse_args(["--load", str(tmp_path / "mlm"), *FLAGS, "--moe-aux-loss-coeff", "0"]))
    got = losses_of(t, 3)
    t.close()
    assert all(abs(g - w) <= 2e-6 * abs(w) for g, w in zip(got, WANT["moe_distopt_ep2_full"]["lm_loss"][3:])), got


def test_the_layer_spec_of_the_buckets_comes_from_the_saved_args(tmp_path):
    """Megatron names the norms alike in both layer specs' files; the order of the buckets differs. The same local-spec
    buckets claimed as Transformer Engine's (``transformer_impl``) do not lay out as that model: refused, not misread."""
    import argparse
    import shutil
    shutil.copytree(DATA / "distopt_dp2", tmp_path / "mlm")
    common = tmp_path / "mlm" / "iter_0000003" / "common.pt"
    from paratron.checkpoint.megatron import _torch_load
    state = _torch_load(common)
    args = vars(state["args"]) if isinstance(state["args"], argparse.Namespace) else dict(state["args"])
    assert args["transformer_impl"] == "local"
    plain = {k: v if isinstance(v, (int, float, str, bool, list, tuple, type(None))) else None for k, v in args.items()}
    state["args"] = argparse.Namespace(**{**plain, "transformer_impl": "transformer_engine"})
    torch.save(state, common)
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    with pytest.raises(CheckpointError, match=r"not laid out as paratron derives it"):
        Trainer(parse_args(["--load", str(tmp_path / "mlm"), *FLAGS]))


def test_common_state_readers_by_hand():
    """The pieces of Megatron's common.pt a resume reads: the plain optimizer's common_step, the distributed one's
    param-group steps (also inside chained optimizers' lists), the fp16 loss scaler, the scheduler's position and
    values in paratron's names, and the sharding type."""
    from paratron.checkpoint import megatron_state as S
    plain = {"optimizer": {"optimizer": {"state": {"common_step": torch.tensor(7.0)}, "param_groups": [{"lr": 1.0}]},
                           "grad_scaler": {"scale": torch.tensor(1024.0), "growth_tracker": 3,
                                           "hysteresis_tracker": 2}},
             "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 40, "lr_decay_steps": 800,
                                     "lr_decay_style": "cosine", "num_steps": 140, "start_wd": 0.1}}
    assert S.adam_step(plain) == 7 and S.sharding_type(plain) is None
    assert S.scaler_state(plain) == {"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 2}
    assert S.scheduler_state(plain) == {"max_lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 40, "decay_steps": 800,
                                        "decay_style": "cosine", "num_steps": 140}
    chained = {"optimizer": [{"optimizer": {"param_groups": [{"step": 5}, {"step": 5}]},
                              "param_state_sharding_type": "fully_reshardable"},
                             {"optimizer": {"param_groups": [{"step": 5}]}}]}
    assert S.adam_step(chained) == 5 and S.sharding_type(chained) == "fully_reshardable"
    assert S.scaler_state(chained) is None and S.scheduler_state(chained) is None
    with pytest.raises(CheckpointError, match=r"names 2 different step counts \[4, 5\]"):
        S.adam_step({"optimizer": [{"param_groups": [{"step": 4}]}, {"param_groups": [{"step": 5}]}]})


def test_a_legacy_checkpoint_too_large_for_the_hosts_memory_is_refused_before_reading():
    """Every rank reads a legacy checkpoint whole: refused (naming the conversion) where this node's processes would
    not fit in the host's available memory."""
    from paratron.checkpoint import megatron_legacy_state as L
    d = next((DATA / "legacy_plain_tp2").glob("iter_*"))
    size = sum(p.stat().st_size for p in d.glob("mp_rank_*/*.pt"))
    L.check_memory(d, 8, 8 * size)
    with pytest.raises(CheckpointError, match=r"read whole by every rank .* convert it once"):
        L.check_memory(d, 8, 8 * size - 1)
