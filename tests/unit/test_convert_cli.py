"""`paratron convert`: checkpoints written by the real training command (one process and TP=2 under
torchrun) convert to Hugging Face directories that transformers loads with paratron's logits; a
Hugging Face model converts to a checkpoint that `pretrain_gpt.py --load --finetune` trains from,
starting from exactly its loss; every TP/PP/DP layout merges back to the one-stage model; bad input
is a one-line error that leaves existing data alone."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from paratron.checkpoint import convert as C  # noqa: E402
from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import local  # noqa: E402
from paratron.config import Config, ModelConfig  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402
from paratron.parallel.dims import ParallelDims  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--num-workers", "0", "--eval-iters", "0"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
# TP=2 pads the vocabulary to a multiple of 128 x 2; 64 x 2 keeps the TP=1 run's 384 rows, so both
# runs train the same model (same seed, same data, no dropout) and end with the same weights up to rounding.
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _train_cmd(save: Path, *extra: str, nproc: int = 1) -> list[str]:
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                                   if nproc > 1 else [])
    return launcher + ["pretrain_gpt.py", *BASE, *extra, "--save", str(save)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The three training runs, started together: GPT-2-style, Llama-style, Llama-style at TP=2."""
    d = tmp_path_factory.mktemp("ckpts")
    runs = {"gpt": _train_cmd(d / "gpt"), "llama": _train_cmd(d / "llama", *LLAMA),
            "llama_tp2": _train_cmd(d / "llama_tp2", *LLAMA, *TP2, nproc=2)}
    procs = {k: subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, cmd in runs.items()}
    for k, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{k}:\n{out[-3000:]}"
    return {k: d / k for k in runs}


def convert(*argv: str) -> int:
    return C.main([str(a) for a in argv])


def paratron_from_checkpoint(root: Path):
    """A one-process GPTModel loaded the way Trainer.load does, from a TP=1 checkpoint."""
    state, meta = local.load_checkpoint(root, ParallelDims(), torch.device("cpu"))
    cfg = ModelConfig(**meta["config"]["model"])
    model = GPTModel(cfg, state["model"]["embedding.word_embeddings.weight"].shape[0])
    model.load_state_dict(state["model"], strict=True)
    return model.eval()


def hf_logits(path: Path, ids: torch.Tensor):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model


IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("run,family", [("gpt", "gpt2"), ("llama", "llama")])
def test_trained_checkpoint_to_hf_gives_paratron_logits(ckpts, tmp_path, run, family):
    out = tmp_path / "hf"
    assert convert("--to", "hf", "--load", ckpts[run], "--output", out, "--dtype", "fp32") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == VOCAB  # the real vocabulary, not 384
    theirs, hf_model = hf_logits(out, IDS)
    with torch.no_grad():
        ours = paratron_from_checkpoint(ckpts[run])(IDS)
    assert ours.shape == (2, 32, 384) and theirs.shape == (2, 32, VOCAB)
    assert (ours[..., :VOCAB] - theirs).abs().max().item() <= 1e-5
    assert theirs.std().item() > 0.05  # not a degenerate comparison
    # the trained weights (not a fresh init) were written
    state, _ = local.load_checkpoint(ckpts[run], ParallelDims(), torch.device("cpu"))
    emb = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    assert torch.equal(hf_model.state_dict()[emb], state["model"]["embedding.word_embeddings.weight"][:VOCAB])


def test_tp2_checkpoint_merges_to_the_tp1_model(ckpts, tmp_path, capsys):
    tp1, tp2, back = tmp_path / "tp1", tmp_path / "tp2", tmp_path / "back"
    assert convert("--to", "hf", "--load", ckpts["llama"], "--output", tp1) == 0
    assert convert("--to", "hf", "--load", ckpts["llama_tp2"], "--output", tp2) == 0
    assert "TP 2 x PP 1" in capsys.readouterr().out
    a, b = load_file(str(tp1 / "model.safetensors")), load_file(str(tp2 / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # same training up to rounding; a wrong merge is off by the init scale (~0.02)
        assert a[name].shape == b[name].shape, name
        assert (a[name] - b[name]).abs().max().item() <= 2e-4, name
    gate0, gate1 = b["model.layers.0.mlp.gate_proj.weight"], b["model.layers.0.mlp.up_proj.weight"]
    assert (gate0 - gate1).abs().max().item() > 1e-2  # the tolerance does tell tensors apart

    # HF -> paratron (TP=1) -> a model loaded from that checkpoint has the HF model's logits.
    assert convert("--from", "hf", "--input", tp2, "--save", back) == 0
    theirs, _ = hf_logits(tp2, IDS)
    with torch.no_grad():
        ours = paratron_from_checkpoint(back)(IDS)[..., :VOCAB]
    assert (ours - theirs).abs().max().item() <= 1e-5


def _random_hf_llama(path: Path, seed: int = 0):
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, rms_norm_eps=1e-6,
        attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # sharp enough that a wrong weight shows in the loss
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * r if p.dim() == 1 else (0.3 * r if "embed" in name else r / p.shape[1] ** 0.5))
    model.save_pretrained(path)
    return model.eval()


def _first_batch(flags: list[str]) -> dict:
    """The first micro-batch pretrain_gpt.py trains on with these flags (its own data pipeline)."""
    from paratron.config import parse_args
    from paratron.data import build_data_iterator, build_tokenizer, build_train_valid_test_datasets
    args = parse_args(flags).flat()
    train, _, _ = build_train_valid_test_datasets(args, build_tokenizer(args))
    return next(build_data_iterator(train, consumed_samples=0, micro_batch_size=args.micro_batch_size,
                                    dp_rank=0, dp_size=1, num_workers=0))


def test_from_hf_then_finetune_starts_from_the_hf_weights(tmp_path, capsys):
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    model = _random_hf_llama(src)
    assert convert("--from", "hf", "--input", src, "--save", ckpt) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  pretrain_gpt.py "))
    printed = shlex.split(line)[1:]
    assert printed[-3:] == ["--load", str(ckpt), "--finetune"]
    for f in ["--num-layers 2", "--hidden-size 64", "--ffn-hidden-size 96", "--num-query-groups 2", "--swiglu",
              "--normalization RMSNorm", "--position-embedding-type rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--norm-epsilon 1e-06"]:
        assert f" {f} " in f" {line} ", f

    # The checkpoint holds exactly the HF weights, in the layout load_checkpoint reads for one process.
    state, meta = local.load_checkpoint(ckpt, ParallelDims(), torch.device("cpu"))
    hf_state, hf_config = H.load_hf_dir(src)
    cfg, vocab, family = H.model_config_from_hf(hf_config)
    want = H.hf_to_paratron(hf_state, cfg, family, 384)
    assert state["model"].keys() == want.keys() and all(torch.equal(state["model"][k], want[k]) for k in want)
    assert (meta["iteration"], meta["world_size"], meta["layout"]["tp"]) == (0, 1, 1)
    assert meta["config"]["data"]["vocab_size"] == VOCAB

    # Train from it with the printed flags; the first logged loss is the HF model's on that batch.
    data = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--num-workers", "0",
            "--eval-iters", "0", "--log-interval", "1"]
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *printed, *data], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"loaded weights from {ckpt}" in r.stdout
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+) \|", r.stdout)]
    batch = _first_batch(printed[:-3] + data)
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits  # [b, s, 300]; paratron's 84 padded columns are 0
        logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], 384 - VOCAB)], dim=-1)
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                      reduction="none")
        mask = batch["loss_mask"].flatten()
        expected = ((per_token * mask).sum() / mask.sum()).item()
    assert len(losses) == 2 and abs(losses[0] - expected) <= 1e-4 * expected, (losses, expected)
    assert abs(expected - math.log(384)) > 0.3  # sharp random weights: far from a fresh init's ln(384)


# ----------------------------------------------------------------------------------------------
# Layouts, built by hand from a one-stage model and the split marks its layers carry
# ----------------------------------------------------------------------------------------------

def _shard(p: torch.Tensor, n: int, r: int) -> torch.Tensor:
    dim = getattr(p, "tp_dim", None)
    if dim is None or n == 1:
        return p.detach().clone()
    blocks = p.detach().chunk(getattr(p, "tp_chunks", 1), dim=dim)
    return torch.cat([b.chunk(n, dim=dim)[r] for b in blocks], dim=dim)


def _write_layout(root: Path, model: GPTModel, cfg: Config, tp: int, pp: int, dp: int, vpp: int) -> None:
    """A checkpoint as Trainer.save writes it with TP x PP (x VPP) x DP ranks, equal layers per chunk:
    virtual stage s = v * pp + r holds layers [s * n, (s + 1) * n), the embedding is on stage 0, the
    final norm and output layer on the last (a tied copy of the embedding there too)."""
    m = cfg.model
    n = m.num_layers // (pp * vpp)
    d = root / "iter_0000007"
    d.mkdir(parents=True)
    params = dict(model.named_parameters())
    for r in range(pp):
        for t in range(tp):
            for k in range(dp):
                state = {"iteration": 7, "consumed_samples": 14}
                for v in range(vpp):
                    s = v * pp + r
                    chunk = {}
                    for name, p in params.items():
                        lm = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
                        if lm:
                            i = int(lm.group(1))
                            if s * n <= i < (s + 1) * n:
                                chunk[f"decoder.layers.{i - s * n}.{lm.group(2)}"] = _shard(p, tp, t)
                        elif name.startswith("embedding.") and s == 0:
                            chunk[name] = _shard(p, tp, t)
                        elif s == pp * vpp - 1 and not name.startswith("embedding."):
                            chunk[name] = _shard(p, tp, t)
                    if s == pp * vpp - 1 and not m.untie_embeddings_and_output_weights and pp * vpp > 1:
                        chunk["output_layer.weight"] = _shard(params["embedding.word_embeddings.weight"], tp, t)
                    if k > 0:  # other data-parallel replicas must not be read
                        chunk = {name: torch.full_like(x, 7.0) for name, x in chunk.items()}
                    state["model" if vpp == 1 else f"model{v}"] = chunk
                torch.save(state, d / f"rank_{t + k * tp + r * tp * dp:05d}.pt")
    meta = {"config": cfg.to_dict(), "iteration": 7, "world_size": tp * pp * dp,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "cp": 1}}
    (d / "metadata.json").write_text(json.dumps(meta))
    (root / local.LATEST).write_text("7")


_LLAMA_CFG = dict(num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                  ffn_hidden_size=96, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  disable_bias_linear=True, untie_embeddings_and_output_weights=True, seq_length=32)
_GPT_CFG = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)


@pytest.mark.parametrize("kind,tp,pp,dp,vpp", [("llama", 2, 2, 2, 2), ("gpt2", 2, 2, 1, 1), ("gpt2", 4, 1, 1, 1),
                                               ("llama", 1, 4, 1, 1)])
def test_every_layout_merges_to_the_one_stage_model(tmp_path, kind, tp, pp, dp, vpp):
    cfg = Config()
    cfg.model = ModelConfig(**(_LLAMA_CFG if kind == "llama" else _GPT_CFG)).fill_defaults()
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    cfg.data.vocab_size = VOCAB
    torch.manual_seed(0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    _write_layout(tmp_path / "ckpt", model, cfg, tp, pp, dp, vpp)
    assert convert("--to", "hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "hf", "--quiet") == 0
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = H.paratron_to_hf(model.state_dict(), cfg.model, kind, VOCAB)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_split_table_agrees_with_the_layers():
    """Every parameter's row in convert.TP_SPLIT is the split its layer marks (tp_dim / tp_chunks)."""
    for kw in (_LLAMA_CFG, _GPT_CFG, dict(_LLAMA_CFG, qk_layernorm=True, add_qkv_bias=True),
               dict(_GPT_CFG, untie_embeddings_and_output_weights=True)):
        cfg = ModelConfig(**kw)
        for name, p in GPTModel(cfg, 384).named_parameters():
            mark = (p.tp_dim, getattr(p, "tp_chunks", 1)) if hasattr(p, "tp_dim") else None
            assert C.tp_split(name, cfg.swiglu) == mark, name
    with pytest.raises(H.ConversionError, match="unknown tensor"):
        C.tp_split("decoder.layers.0.mlp.experts.weight", False)


def test_from_hf_at_tp2_round_trips(tmp_path):
    src = tmp_path / "hf"
    _random_hf_llama(src, seed=1)
    assert convert("--from", "hf", "--input", src, "--save", tmp_path / "ckpt", "--tensor-model-parallel-size", "2",
                   "--quiet") == 0
    for r in range(2):  # what a 2-process TP=2 run loads
        state, meta = local.load_checkpoint(tmp_path / "ckpt", ParallelDims(world_size=2, rank=r, tp=2, tp_rank=r),
                                            torch.device("cpu"))
        assert state["model"]["embedding.word_embeddings.weight"].shape == (256, 64)  # 512 padded rows / 2
    assert convert("--to", "hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "back", "--quiet") == 0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_flags_rebuild_the_model_config():
    from paratron.config import parse_args
    m = ModelConfig(**dict(_LLAMA_CFG, kv_channels=32, rotary_base=5e5, use_rope_scaling=True, rope_scaling_factor=4.0,
                           norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
                           init_method_std=0.01)).fill_defaults()
    flags = C.training_flags(m)
    cfg = parse_args(flags + ["--train-iters", "1", "--lr", "1e-4", "--mock-data"])
    assert cfg.model == m
    cfg = parse_args(C.training_flags(ModelConfig(**_GPT_CFG).fill_defaults()) + ["--train-iters", "1", "--lr", "1",
                                                                                 "--mock-data"])
    assert cfg.model == ModelConfig(**_GPT_CFG).fill_defaults()


# ----------------------------------------------------------------------------------------------
# Errors: one line, exit code 2, existing data untouched
# ----------------------------------------------------------------------------------------------

def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_src")
    _random_hf_llama(d, seed=2)
    return d


def test_errors_are_one_line(ckpts, hf_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    taken_hf = tmp_path / "taken_hf"
    assert convert("--to", "hf", "--load", ckpts["gpt"], "--output", taken_hf, "--quiet") == 0
    (taken_hf / "tokenizer.json").write_text("{}")
    taken_ckpt = ckpts["llama"]
    before_hf, before_ckpt = _snapshot(taken_hf), _snapshot(taken_ckpt)
    cases = {
        "does not exist": ["--to", "hf", "--load", tmp_path / "nope", "--output", tmp_path / "o1"],
        "no paratron checkpoint": ["--to", "hf", "--load", empty, "--output", tmp_path / "o2"],
        "unknown family 'falcon'": ["--to", "hf", "--load", ckpts["gpt"], "--output", tmp_path / "o3",
                                    "--family", "falcon"],
        "gpt2 cannot represent this model": ["--to", "hf", "--load", ckpts["llama"], "--output", tmp_path / "o4",
                                             "--family", "gpt2"],
        "has no iteration 5": ["--to", "hf", "--load", ckpts["gpt"], "--output", tmp_path / "o5", "--iteration", "5"],
        "already holds a Hugging Face checkpoint": ["--to", "hf", "--load", ckpts["llama"], "--output", taken_hf],
        "unsupported model_type 'bert'": ["--from", "hf", "--input", bert, "--save", tmp_path / "o6"],
        "has no config.json": ["--from", "hf", "--input", empty, "--save", tmp_path / "o7"],
        "already holds a paratron checkpoint": ["--from", "hf", "--input", hf_dir, "--save", taken_ckpt],
        "not divisible by --tensor-model-parallel-size 3": ["--from", "hf", "--input", hf_dir, "--save",
                                                            tmp_path / "o8", "--tensor-model-parallel-size", "3"],
        "exactly one of --to hf or --from hf": ["--load", ckpts["gpt"]],
        "--family does not apply": ["--from", "hf", "--input", hf_dir, "--save", tmp_path / "o9", "--family", "gpt2"],
    }
    from paratron.cli import main as cli_main
    for expect, argv in cases.items():
        capsys.readouterr()
        assert cli_main(["convert", *map(str, argv)]) == 2, expect
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paratron convert: error: ") and expect in err, (expect, err)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 10))  # nothing half-written
    assert not list(tmp_path.glob(".*convert*")) and not list(taken_hf.parent.glob(".*convert*"))
    assert _snapshot(taken_hf) == before_hf and _snapshot(taken_ckpt) == before_ckpt

    # The real command line, in a fresh process: no traceback.
    r = subprocess.run([sys.executable, "-m", "paratron", "convert", *map(str, cases["unsupported model_type 'bert'"])],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unsupported model_type" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_force_replaces_and_keeps_other_files(ckpts, hf_dir, tmp_path):
    out = tmp_path / "hf"
    assert convert("--to", "hf", "--load", ckpts["gpt"], "--output", out, "--quiet") == 0
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_text("stale shard")
    assert convert("--to", "hf", "--load", ckpts["llama"], "--output", out, "--force", "--quiet") == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]

    ckpt = tmp_path / "ckpt"
    assert convert("--from", "hf", "--input", hf_dir, "--save", ckpt, "--quiet") == 0
    (ckpt / "iter_0000050").mkdir()  # an older training checkpoint
    (ckpt / local.LATEST).write_text("50")
    (ckpt / "notes.txt").write_text("mine")
    assert convert("--from", "hf", "--input", hf_dir, "--save", ckpt, "--force", "--quiet") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000000", local.LATEST, "notes.txt"]
    assert local.load_checkpoint(ckpt, ParallelDims(), torch.device("cpu"))[1]["iteration"] == 0
