"""`paratron convert`: sharded checkpoints written by the real training command (one process, and
TP=2 x PP=2 under torchrun) convert to Hugging Face directories that transformers loads with
paratron's logits; the multi-rank run converts to the one-process run's weights; a Hugging Face model
converts to a checkpoint that `pretrain_gpt.py --load [--finetune]` trains from (one process and
TP=2), starting from exactly its loss; bad input is a one-line error that leaves existing data alone."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from paratron.checkpoint import convert as C  # noqa: E402
from paratron.checkpoint import hf as H  # noqa: E402
from paratron.checkpoint import hf_config as HC  # noqa: E402
from paratron.checkpoint import sharded  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.model.gpt import GPTModel  # noqa: E402
from tests.parallel.cli import Launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--adam-eps", "1e-6", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(VOCAB), "--num-workers", "0", "--eval-iters", "0"]
_ROPE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = _ROPE + ["--untie-embeddings-and-output-weights"]
QWEN2 = _ROPE + ["--add-qkv-bias"]  # tied embeddings: with PP the last stage holds a copy
# TP=2 pads the vocabulary to a multiple of 128 x 2; 64 x 2 keeps the TP=1 run's 384 rows, so both
# runs train the same model (same seed, same data, no dropout) and end with the same weights up to
# rounding. (--adam-eps 1e-6: the key bias's gradient is rounding noise that eps 1e-8 would blow up.)
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--make-vocab-size-divisible-by", "64"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _run_all(runs: dict, timeout: int = 300) -> dict:
    """Start the runs {name: (processes, argv)} together (tests/parallel/cli.py's ranks); {name: stdout}; each must
    exit 0."""
    with tempfile.TemporaryDirectory() as tmp:
        launches = {}
        for k, (nproc, argv) in runs.items():
            (Path(tmp) / k).mkdir()
            launches[k] = Launch(nproc, argv[0], argv[1:], Path(tmp) / k, ENV)
        outs = {}
        try:
            for k, launch in launches.items():
                r = launch.wait(timeout)
                outs[k] = r.stdout + r.stderr
                assert r.returncode == 0, f"{k}:\n{outs[k][-3000:]}"
        finally:
            for launch in launches.values():
                launch.kill()
    return outs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The training runs, started together: GPT-2-style (saving iterations 1 and 2), Llama-style,
    Qwen2-style, and Qwen2-style at TP=2 x PP=2 (4 processes)."""
    d = tmp_path_factory.mktemp("ckpts")
    runs = {"gpt": (1, ["--save-interval", "1"]), "llama": (1, LLAMA), "qwen2": (1, QWEN2),
            "qwen2_tp2_pp2": (4, QWEN2 + TP2_PP2)}
    _run_all({k: (n, ["pretrain_gpt.py", *BASE, *extra, "--save", str(d / k)]) for k, (n, extra) in runs.items()})
    return {k: d / k for k in runs}


def convert(*argv: str) -> int:
    return C.main([str(a) for a in argv])


def saved_model_state(root: Path, iteration: int = None) -> tuple[dict, dict]:
    """(the model.* tensors without the prefix, common.json) of a checkpoint, read directly."""
    d = sharded.find_checkpoint(root, group=sharded.SOLO, iteration=iteration)
    keys = [k for k in sharded.tensor_shapes(d) if k.startswith("model.")]
    return {k[len("model."):]: t for k, t in sharded.load_full(d, keys).items()}, sharded.read_common(d)


def paratron_from_checkpoint(root: Path):
    """A one-process GPTModel holding a checkpoint's weights (strict: every parameter, nothing else)."""
    state, common = saved_model_state(root)
    model = GPTModel(ModelConfig(**common["config"]["model"]).resolved(),
                     state["embedding.word_embeddings.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_logits(path: Path, ids: torch.Tensor):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model


IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("run,family", [("gpt", "gpt2"), ("llama", "llama"), ("llama", "mistral"),
                                        ("qwen2", "qwen2"), ("qwen2_tp2_pp2", "qwen2")])
def test_trained_checkpoint_to_hf_gives_paratron_logits(ckpts, tmp_path, run, family):
    out = tmp_path / "hf"
    assert convert("--to", "hf", "--load", ckpts[run], "--output", out, "--dtype", "fp32", "--family", family) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == VOCAB  # the real vocabulary, not 384
    assert config["paratron"]["iteration"] == 2
    theirs, hf_model = hf_logits(out, IDS)
    with torch.no_grad():
        ours = paratron_from_checkpoint(ckpts[run])(IDS)
    assert ours.shape == (2, 32, 384) and theirs.shape == (2, 32, VOCAB)
    assert (ours[..., :VOCAB] - theirs).abs().max().item() <= 1e-5
    assert theirs.std().item() > 0.05  # not a degenerate comparison
    # the trained weights were written, as saved
    state, _ = saved_model_state(ckpts[run])
    emb = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    assert torch.equal(hf_model.state_dict()[emb], state["embedding.word_embeddings.weight"][:VOCAB])


def test_default_family_and_iteration(ckpts, tmp_path, capsys):
    """No --family: the model config decides; --iteration N converts that iteration, not the latest."""
    for run, family in (("gpt", "gpt2"), ("llama", "llama"), ("qwen2", "qwen2")):
        assert convert("--to", "hf", "--load", ckpts[run], "--output", tmp_path / run, "--quiet") == 0
        assert json.loads((tmp_path / run / "config.json").read_text())["model_type"] == family
    assert convert("--to", "hf", "--load", ckpts["gpt"], "--output", tmp_path / "it1", "--iteration", "1") == 0
    assert "iteration 1" in capsys.readouterr().out
    assert json.loads((tmp_path / "it1" / "config.json").read_text())["paratron"]["iteration"] == 1
    it1, it2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("it1", "gpt"))
    want1 = H.paratron_to_hf(saved_model_state(ckpts["gpt"], 1)[0], HC.model_config_from_hf(
        json.loads((tmp_path / "it1" / "config.json").read_text()))[0], "gpt2", VOCAB)
    assert it1.keys() == want1.keys() and all(torch.equal(it1[k], want1[k]) for k in want1)
    assert not torch.equal(it1["transformer.h.0.mlp.c_fc.weight"], it2["transformer.h.0.mlp.c_fc.weight"])


def test_tp2_pp2_checkpoint_converts_to_the_one_process_model(ckpts, tmp_path, capsys):
    one, multi, back = tmp_path / "one", tmp_path / "multi", tmp_path / "back"
    assert convert("--to", "hf", "--load", ckpts["qwen2"], "--output", one) == 0
    assert convert("--to", "hf", "--load", ckpts["qwen2_tp2_pp2"], "--output", multi) == 0
    assert "saved by 4 rank(s): TP 2 x PP 2 x DP 1" in capsys.readouterr().out
    a, b = load_file(str(one / "model.safetensors")), load_file(str(multi / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # tied
    for name in a:  # same training up to rounding; a wrong piece is off by the init scale (~0.02)
        assert a[name].shape == b[name].shape, name
        assert (a[name] - b[name]).abs().max().item() <= 2e-4, name
    gate, up = b["model.layers.1.mlp.gate_proj.weight"], b["model.layers.1.mlp.up_proj.weight"]
    assert (gate - up).abs().max().item() > 1e-2  # the tolerance does tell tensors apart

    # HF -> paratron -> a model loaded from that checkpoint has the HF model's logits.
    assert convert("--from", "hf", "--input", multi, "--save", back) == 0
    theirs, _ = hf_logits(multi, IDS)
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
    from paratron.data import (build_data_iterator, build_tokenizer, build_train_valid_test_datasets,
                               train_valid_test_num_samples)
    cfg = parse_args(flags)
    train, _, _ = build_train_valid_test_datasets(cfg.data, build_tokenizer(cfg.data), cfg.model.seq_length,
                                                  cfg.train.seed, train_valid_test_num_samples(cfg.train))
    return next(build_data_iterator(train, consumed_samples=0, micro_batch_size=cfg.train.micro_batch_size,
                                    dp_rank=0, dp_size=1, num_workers=0))


def _printed_command(out: str) -> tuple[str, list[str], list[str]]:
    line = next(ln for ln in out.splitlines() if ln.startswith("  ") and "pretrain_gpt.py " in ln)
    words = shlex.split(line)
    i = words.index("pretrain_gpt.py")
    return line, words[:i], words[i + 1:]


def test_from_hf_then_training_starts_from_the_hf_weights(tmp_path, capsys):
    src, ckpt, ckpt2 = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "ckpt_tp2"
    model = _random_hf_llama(src)
    assert convert("--from", "hf", "--input", src, "--save", ckpt) == 0
    line, launcher, printed = _printed_command(capsys.readouterr().out)
    assert launcher == [] and printed[-3:] == ["--load", str(ckpt), "--finetune"]
    for f in ["--num-layers 2", "--hidden-size 64", "--ffn-hidden-size 96", "--num-query-groups 2", "--swiglu",
              "--normalization RMSNorm", "--position-embedding-type rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--norm-epsilon 1e-06"]:
        assert f" {f} " in f" {line} ", f
    assert convert("--from", "hf", "--input", src, "--save", ckpt2, "--tensor-model-parallel-size", "2") == 0
    _, launcher2, printed2 = _printed_command(capsys.readouterr().out)
    assert launcher2 == ["torchrun", "--nproc-per-node", "2"]
    assert printed2[:-3] == printed[:-3] + ["--tensor-model-parallel-size", "2"]

    # The checkpoint holds exactly the HF weights as whole tensors, at iteration 0, weights only.
    state, common = saved_model_state(ckpt)
    hf_state, hf_config = H.load_hf_dir(src)
    cfg, vocab, family = HC.model_config_from_hf(hf_config)
    want = H.hf_to_paratron(hf_state, cfg, family, 384)
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert sharded.find_checkpoint(ckpt, group=sharded.SOLO) == sharded.iter_dir(ckpt, 0)
    assert (common["iteration"], common["consumed_samples"], common["optimizer"], common["rng"]) == (0, 0, None, False)
    assert common["layout"]["world_size"] == 1 and common["config"]["data"]["vocab_size"] == VOCAB
    assert not any(k.startswith(("optimizer.", "rng.")) for k in sharded.tensor_shapes(sharded.iter_dir(ckpt, 0)))
    # ... and for TP=2 the vocabulary padded as a TP=2 run pads it (512 rows, zeros past 300).
    state2, _ = saved_model_state(ckpt2)
    emb = state2["embedding.word_embeddings.weight"]
    assert emb.shape == (512, 64) and torch.equal(emb[:384], want["embedding.word_embeddings.weight"])
    assert not emb[VOCAB:].any()

    # Train from them with the printed flags: one process --finetune, and TP=2 (2 processes) with a
    # plain --load; the first logged loss of each is the HF model's on that batch.
    data = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--num-workers", "0",
            "--eval-iters", "0", "--log-interval", "1"]
    outs = _run_all({"tp1": (1, ["pretrain_gpt.py", *printed, *data]),
                     "tp2": (2, ["pretrain_gpt.py", *printed2[:-1], *data])})
    assert f"loaded weights from {sharded.iter_dir(ckpt, 0)}" in outs["tp1"]
    assert f"resumed from {sharded.iter_dir(ckpt2, 0)} at iteration 0" in outs["tp2"]
    batch = _first_batch(printed[:-3] + data)
    for run, padded in (("tp1", 384), ("tp2", 512)):
        losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+) \|", outs[run])]
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"]).logits  # [b, s, 300]; paratron's padded columns are 0
            logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], padded - VOCAB)], dim=-1)
            per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                          reduction="none")
            mask = batch["loss_mask"].flatten()
            expected = ((per_token * mask).sum() / mask.sum()).item()
        assert len(losses) == 2 and abs(losses[0] - expected) <= 1e-4 * expected, (run, losses, expected)
        assert abs(expected - math.log(padded)) > 0.3  # sharp random weights: far from a fresh init's


def test_from_hf_round_trips(tmp_path):
    src = tmp_path / "hf"
    _random_hf_llama(src, seed=1)
    assert convert("--from", "hf", "--input", src, "--save", tmp_path / "ckpt", "--dtype", "bf16", "--quiet") == 0
    state, _ = saved_model_state(tmp_path / "ckpt")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert convert("--to", "hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "back", "--quiet") == 0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert convert("--from", "hf", "--input", src, "--save", tmp_path / "ckpt32", "--quiet") == 0
    assert convert("--to", "hf", "--load", tmp_path / "ckpt32", "--output", tmp_path / "back32", "--quiet") == 0
    c = load_file(str(tmp_path / "back32" / "model.safetensors"))
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)  # exact


_LLAMA_CFG = dict(num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                  ffn_hidden_size=96, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  disable_bias_linear=True, untie_embeddings_and_output_weights=True, seq_length=32)
_GPT_CFG = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)


def test_training_flags_rebuild_the_model_config():
    from paratron.config import parse_args
    m = ModelConfig(**dict(_LLAMA_CFG, kv_channels=32, rotary_base=5e5, use_rope_scaling=True, rope_scaling_factor=4.0,
                           norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
                           init_method_std=0.01)).resolved()
    flags = C.training_flags(m)
    cfg = parse_args(flags + ["--train-iters", "1", "--lr", "1e-4", "--mock-data"])
    assert cfg.model == m
    cfg = parse_args(C.training_flags(ModelConfig(**_GPT_CFG).resolved()) + ["--train-iters", "1", "--lr", "1",
                                                                                 "--mock-data"])
    assert cfg.model == ModelConfig(**_GPT_CFG).resolved()


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints, errors: one line, exit code 2, existing data untouched
# ----------------------------------------------------------------------------------------------

def test_damaged_latest_falls_back_with_a_warning(ckpts, tmp_path, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(ckpts["gpt"], root)
    chunk = next(sharded.iter_dir(root, 2).glob("*.distcp"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert convert("--to", "hf", "--load", root, "--output", tmp_path / "hf", "--quiet") == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and chunk.name in err and "falling back to" in err, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["paratron"]["iteration"] == 1
    assert convert("--to", "hf", "--load", root, "--output", tmp_path / "hf2", "--iteration", "2") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CRC-32 mismatch" in err and chunk.name in err, err
    assert not (tmp_path / "hf2").exists()


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
    old = tmp_path / "old_format"  # a checkpoint of the per-rank format paratron used to write
    (old / "iter_0000007").mkdir(parents=True)
    torch.save({"model": {}}, old / "iter_0000007" / "rank_00000.pt")
    (old / "iter_0000007" / "metadata.json").write_text(json.dumps({"config": {"model": {}}, "iteration": 7}))
    (old / sharded.LATEST).write_text("7")
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
        "asked for iteration 5": ["--to", "hf", "--load", ckpts["gpt"], "--output", tmp_path / "o5",
                                  "--iteration", "5"],
        "per-rank checkpoint (rank_*.pt) of an older paratron": ["--to", "hf", "--load", old, "--output",
                                                                   tmp_path / "o10"],
        "already holds a Hugging Face checkpoint": ["--to", "hf", "--load", ckpts["llama"], "--output", taken_hf],
        "post-LayerNorm": ["--from", "hf", "--input", bert, "--save", tmp_path / "o6"],
        "has no config.json": ["--from", "hf", "--input", empty, "--save", tmp_path / "o7"],
        "already holds a paratron checkpoint": ["--from", "hf", "--input", hf_dir, "--save", taken_ckpt],
        "not divisible by --tensor-model-parallel-size 3": ["--from", "hf", "--input", hf_dir, "--save",
                                                            tmp_path / "o8", "--tensor-model-parallel-size", "3"],
        "exactly one of --to hf, --from hf, --from megatron or --from torchtitan": ["--load", ckpts["gpt"]],
        "--family does not apply": ["--from", "hf", "--input", hf_dir, "--save", tmp_path / "o9", "--family", "gpt2"],
    }
    from paratron.cli import main as cli_main
    for expect, argv in cases.items():
        capsys.readouterr()
        assert cli_main(["convert", *map(str, argv)]) == 2, expect
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paratron convert: error: ") and expect in err, (expect, err)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 11))  # nothing half-written
    assert not list(tmp_path.glob(".*convert*")) and not list(taken_hf.parent.glob(".*convert*"))
    assert _snapshot(taken_hf) == before_hf and _snapshot(taken_ckpt) == before_ckpt

    # The real command line, in a fresh process: no traceback.
    r = subprocess.run([sys.executable, "-m", "paratron", "convert", *map(str, cases["post-LayerNorm"])],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "post-LayerNorm" in r.stderr, r.stderr
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
    (ckpt / sharded.LATEST).write_text("50")
    (ckpt / "notes.txt").write_text("mine")
    assert convert("--from", "hf", "--input", hf_dir, "--save", ckpt, "--force", "--quiet") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000000", sharded.LATEST, "notes.txt"]
    d = sharded.find_checkpoint(ckpt, group=sharded.SOLO)
    assert d == sharded.iter_dir(ckpt, 0) and sharded.read_common(d)["iteration"] == 0
