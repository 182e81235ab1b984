"""``paratron convert --to megatron``: a paratron checkpoint written as Megatron-LM's torch_dist checkpoint with the
distributed optimizer's state. The export of the state Megatron itself saved (tests/data/megatron_ckpt/optim, resumed
here) has Megatron's own tensor and object names and shapes, its param groups, scheduler and content metadata; read
back, it continues Megatron's losses."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from paratron.checkpoint import convert as C
from paratron.checkpoint.hf_config import ConversionError
from paratron.checkpoint.megatron import _torch_load
from paratron.checkpoint.pieces import SafeReader, read_objects
from tests.unit.test_megatron_resume import DATA, FLAGS, WANT


def _trainer(*argv):
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    return Trainer(parse_args(list(argv)))


def _export(tmp_path, case: str, extra: list, steps: int = 0, ep: int = 1, plain: bool = False):
    """Resume Megatron's ``case`` at iteration 3, train ``steps``, save, export (for a Megatron run at expert-parallel
    size ``ep``); the export's directory."""
    from tests.unit.test_train import losses_of
    t = _trainer("--load", str(DATA / case), *FLAGS, *extra, "--save", str(tmp_path / "p"))
    losses_of(t, steps)
    t.save()
    t.close()
    assert C.main(["--to", "megatron", "--load", str(tmp_path / "p"), "--output", str(tmp_path / "m"), "--quiet",
                   "--expert-model-parallel-size", str(ep)] + ["--plain-optimizer"] * plain) == 0
    return tmp_path / "m" / f"iter_{3 + steps:07d}"


def _entries(d) -> dict:
    md = SafeReader(str(d)).read_metadata().state_dict_metadata
    return {k: tuple(v.size) if hasattr(v, "size") else "bytes" for k, v in md.items()}


@pytest.mark.parametrize("case,extra,ep,plain", [
    ("moe_distopt_ep2_full", ["--moe-aux-loss-coeff", "0"], 2, False),  # stacked layers; experts chained
    ("moe_mixed_shared", ["--moe-aux-loss-coeff", "0"], 1, False),  # a dense and an MoE layer: per-layer names
    ("mla", [], 1, False),  # multi-latent attention: its norms keep their names
    ("plain_tp2_bf16", ["--bf16"], 1, True),  # Megatron's plain optimizer: fp32_param, common_step
])
def test_export_has_megatrons_own_names_shapes_and_common_state(tmp_path, case, extra, ep, plain):
    """Against the checkpoint Megatron wrote of the same state (fully reshardable): the same tensors and byte objects
    (model, optimizer.state.param / exp_avg / exp_avg_sq, every linear's _extra_state) with Megatron's contents, the
    optimizer's param groups (their keys, step, LR; chained at EP 2), scheduler, content metadata, checked args."""
    out = _export(tmp_path, case, extra, ep=ep, plain=plain)
    theirs = DATA / case / "iter_0000003"
    assert _entries(out) == _entries(theirs)
    objects = [k for k, v in _entries(theirs).items() if v == "bytes"]
    assert objects and read_objects(out, objects) == read_objects(theirs, objects)  # (what Megatron's loader unpickles)
    ours, megatron = _torch_load(out / "common.pt"), _torch_load(theirs / "common.pt")
    assert ours["content_metadata"] == megatron["content_metadata"]
    assert ours["opt_param_scheduler"] == megatron["opt_param_scheduler"]
    assert (ours["iteration"], ours["checkpoint_version"]) == (megatron["iteration"], megatron["checkpoint_version"])
    chains = (0, 1) if ep > 1 else (None,)
    for i in chains:
        a = (ours["optimizer"] if i is None else ours["optimizer"][i])["optimizer"]
        b = (megatron["optimizer"] if i is None else megatron["optimizer"][i])["optimizer"]
        assert sorted(a) == sorted(b) and a.get("state", {}).keys() == b.get("state", {}).keys()
        assert float(a.get("state", {}).get("common_step", 0)) == float(b.get("state", {}).get("common_step", 0))
        a, b = a["param_groups"], b["param_groups"]
        assert [sorted(g) for g in a] == [sorted(g) for g in b]
        assert [(g["wd_mult"], g["is_expert_parallel"], g.get("step")) for g in a] == \
            [(g["wd_mult"], g["is_expert_parallel"], g.get("step")) for g in b]
        assert all(abs(x["lr"] - y["lr"]) < 1e-12 for x, y in zip(a, b))
    assert ours["args"].consumed_train_samples == 6
    for name in ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
                 "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type"):  # Megatron's checked args
        assert getattr(ours["args"], name) == getattr(megatron["args"], name), name
    assert (out.parent / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_export_read_back_continues_megatrons_run(tmp_path):
    """paratron resumes Megatron's iteration 3, trains iteration 4, exports; resumed from the export, iterations 5 and
    6 give Megatron's own losses (dp_reshardable in, fully reshardable out)."""
    from tests.unit.test_train import losses_of
    out = _export(tmp_path, "distopt_dp2", [], steps=1)
    t = _trainer("--load", str(out.parent), *FLAGS)
    assert (t.iteration, t.consumed_samples) == (4, 8)
    got = losses_of(t, 2)
    t.close()
    assert all(abs(g - w) <= 2e-6 * w for g, w in zip(got, WANT["distopt_dp2"]["lm_loss"][4:6])), got


def test_export_refusals(tmp_path):
    from paratron.checkpoint import to_megatron as M
    from paratron.config import ModelConfig
    hybrid = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hybrid_layer_pattern="M*",
                         mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8)
    M.check_exportable(hybrid)  # (Mamba-2 hybrid stacks are written: tests/unit/test_megatron_hybrid.py)
    with pytest.raises(ConversionError, match=r"this one has linear-attention layers"):
        M.check_exportable(dataclasses.replace(hybrid, hybrid_layer_pattern="G*"))
    shutil.copytree(DATA / "distopt_dp2", tmp_path / "mlm")
    code = C.main(["--to", "megatron", "--load", str(tmp_path / "mlm"), "--output", str(tmp_path / "x")])
    assert code == 2  # (a Megatron checkpoint is not paratron's: the one-line error names the conversion)
    assert M.megatron_name("decoder.layers.3.input_layernorm.weight") == \
        ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)
    assert M.megatron_name("mtp.layers.0.mtp_model_layer.mlp.linear_fc2.weight") == \
        ("mtp.layers.0.transformer_layer.mlp.linear_fc2.weight", None)
    assert torch.equal(M.stack({"decoder.layers.1.x": torch.ones(2), "decoder.layers.0.x": torch.zeros(2)})
                       ["decoder.layers.x"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_weights_only_checkpoint_exports_without_optimizer_state(tmp_path):
    """A checkpoint without optimizer state (here converted from Megatron's own weights-only save) exports the
    model alone: no optimizer tensors, no param groups or schedule; the weights read back are the same."""
    from tests.unit.test_megatron_fixtures import DATA as MLM
    C.from_megatron(MLM / "dist_gpt_tp2", tmp_path / "p", log=lambda *a: None)
    assert C.main(["--to", "megatron", "--load", str(tmp_path / "p"), "--output", str(tmp_path / "m"), "--quiet"]) == 0
    out = tmp_path / "m" / "iter_0000000"
    assert not [k for k in _entries(out) if k.startswith("optimizer.")]
    top = _torch_load(out / "common.pt")
    assert "optimizer" not in top and "opt_param_scheduler" not in top
    theirs = {k: v for k, v in _entries(MLM / "dist_gpt_tp2" / "iter_0000010").items() if "rng" not in k}
    assert _entries(out) == theirs  # (Megatron's own weights-only save of the same model)
