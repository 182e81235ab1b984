"""``paratron convert --from megatron`` on checkpoints Megatron-LM itself wrote (tests/data/megatron_ckpt: Megatron
Core 0.16.1's save_checkpoint at TP 2, dense and MoE, torch_dist and legacy; a dense model with an MTP layer at TP 1):
the converted paratron model computes Megatron's logits (and its MTP head's)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratron.checkpoint import convert as C
from paratron.model.gpt import GPTModel

DATA = Path(__file__).resolve().parent.parent / "data" / "megatron_ckpt"
CASES = [("dist", "gpt_tp2"), ("legacy", "gpt_tp2"), ("legacy", "moe_seq_tp2"), ("dist", "moe_gg_tp2"),
         ("legacy", "moe_gg_tp2"), ("dist", "mtp_tp1")]


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


def _run_flags(flags: list, *extra) -> list:
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--num-workers", "0", "--eval-iters",
            "0", "--seed", "3"]
    return [f for f in flags if f not in ("--load", "--finetune")] + data + list(extra)


def test_converted_mtp_head_gives_megatrons_mtp_logits(tmp_path):
    """Megatron saves a GPT model's MTP layer as ``mtp.layers.{k}.transformer_layer.`` (Megatron Core's in-memory and
    paratron's ``mtp_model_layer``): converted, the first prediction depth's logits (token t + 2) equal Megatron's."""
    ref = torch.load(DATA / "reference_mtp_tp1.pt", weights_only=True)
    C.from_megatron(DATA / "dist_mtp_tp1", tmp_path / "out", log=lambda *a: None)
    cfg, _, _, state = C.read_checkpoint(tmp_path / "out", log=lambda *a: None)
    assert cfg.model.mtp_num_layers == 1
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    tokens = ref["tokens"]
    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    with torch.no_grad():
        model.eval()
        ctx = model._context(model.rotary(s, None), None, None)
        hidden = model.decoder(model.embedding(tokens, pos), ctx)
        depth1 = model.mtp(hidden, tokens, pos, ctx, model.embedding)[0]
        logits = model.output_layer(model.head_input(depth1), model.output_weight()).transpose(0, 1).float()
    assert (logits - ref["mtp_logits"]).abs().max() < 1e-4 * ref["mtp_logits"].abs().max()


@pytest.mark.parametrize("case", ["gpt_tp2", "moe_gg_tp2", "mtp_tp1"])
def test_finetune_loads_megatrons_torch_dist_checkpoint_directly(tmp_path, case):
    """--load MEGATRON_DIR --finetune (and --pretrained-checkpoint; and with --use-checkpoint-args, the model flags
    from Megatron's saved args) read Megatron's torch_dist files in the run's layout: the same weights and first
    loss as the converted checkpoint."""
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_train import losses_of
    flags = C.from_megatron(DATA / f"dist_{case}", tmp_path / "conv", log=lambda *a: None)
    runs = {}
    for name, given, extra in (("direct", flags, ["--load", str(DATA / f"dist_{case}"), "--finetune"]),
                               ("pretrained", flags, ["--pretrained-checkpoint", str(DATA / f"dist_{case}")]),
                               ("args", [], ["--load", str(DATA / f"dist_{case}"), "--finetune",
                                             "--use-checkpoint-args"]),
                               ("converted", flags, ["--load", str(tmp_path / "conv"), "--finetune"])):
        t = Trainer(parse_args(_run_flags(given, *extra)))
        weights = {k: v.clone() for k, v in t.models[0].state_dict().items()}
        runs[name] = (weights, losses_of(t, 1)[0])
        t.close()
    for name in ("direct", "pretrained", "args"):
        assert runs[name][0].keys() == runs["converted"][0].keys()
        assert all(torch.equal(runs[name][0][k], v) for k, v in runs["converted"][0].items())
        assert runs[name][1] == runs["converted"][1]


def test_megatron_directories_without_optimizer_state_resume_only_without_it_and_are_not_saved_into(tmp_path):
    """A Megatron checkpoint saved with --no-save-optim resumes (its iteration and consumed samples) only with
    --no-load-optim, as Megatron asks (its legacy format alike, whose weights --finetune reads); --save into Megatron's
    directory would replace its tracker: refused before anything is written."""
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    flags = C.from_megatron(DATA / "dist_gpt_tp2", tmp_path / "conv", log=lambda *a: None)
    with pytest.raises(Exception, match=r"iter_0000010 holds no optimizer state \(saved with --no-save-optim\?\): "
                                        r"pass --no-load-optim or --finetune"):
        Trainer(parse_args(_run_flags(flags, "--load", str(DATA / "dist_gpt_tp2"))))
    t = Trainer(parse_args(_run_flags(flags, "--load", str(DATA / "dist_gpt_tp2"), "--no-load-optim",
                                      "--train-iters", "12")))
    assert (t.iteration, t.consumed_samples) == (10, 20)
    t.close()
    with pytest.raises(Exception, match=r"iter_0000010 holds no optimizer state \(saved with --no-save-optim\?\): "
                                        r"pass --no-load-optim or --finetune"):  # (the legacy format alike)
        Trainer(parse_args(_run_flags(flags, "--load", str(DATA / "legacy_gpt_tp2"))))
    t = Trainer(parse_args(_run_flags(flags, "--load", str(DATA / "legacy_gpt_tp2"), "--finetune")))
    assert (t.iteration, t.consumed_samples) == (0, 0)
    t.close()
    before = sorted(p.name for p in (DATA / "dist_gpt_tp2").rglob("*"))
    with pytest.raises(Exception, match=r"--save .* paratron's saves would replace its latest_checkpointed_"):
        Trainer(parse_args(_run_flags(flags, "--save", str(DATA / "dist_gpt_tp2"))))
    assert sorted(p.name for p in (DATA / "dist_gpt_tp2").rglob("*")) == before


@pytest.mark.parametrize("case", ["moe_mixed_shared", "mla"])
def test_converted_mixed_moe_and_mla_give_megatrons_logits(tmp_path, case):
    """A dense and an MoE layer with a shared expert (Megatron's per-layer names), and multi-latent attention (its
    norms under their own names; Megatron's default yarn RoPE at factor 1): Megatron's logits."""
    ref = torch.load(DATA / "optim" / f"{case}_reference.pt", weights_only=True)
    C.from_megatron(DATA / "optim" / case, tmp_path / "out", log=lambda *a: None)
    cfg, _, _, state = C.read_checkpoint(tmp_path / "out", log=lambda *a: None)
    assert bool(cfg.model.multi_latent_attention) == (case == "mla")
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"]).float()
    assert (logits - ref["logits"]).abs().max() < 1e-4 * ref["logits"].abs().max()
