"""Megatron-LM's flag surface (issue 19): every Megatron flag is implemented, accepted with a reason or
refused by name; no accepted flag is silent; --help and the generated docs cover them; all problems
of a command line come together; TensorBoard holds Megatron's tags."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paratron.config import ConfigError
from paratron.train.resolve import parse_args
from paratron.config.docs import megatron_flags_markdown
from paratron.config.megatron_flags import (ACCEPTED_STATUS, IMPLEMENTED, REFUSED_STATUS, megatron_flags, status)
from paratron.config.megatron_reasons import ACCEPTED, GROUP_REASONS, HONOURED_FIELDS, PREFIX_REASONS, REFUSED
from paratron.config.parse import flag_problem
from paratron.config.sections import FIELD_SECTION

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "megatron_flags.tsv"
BASE = ["--mock-data", "--train-iters", "2", "--lr", "1e-3", "--num-workers", "0"]


def megatron_list() -> list[tuple[str, str, str, int]]:
    """(flag, group, nargs, uses in Megatron's GPT/Llama/MoE scripts) of tests/data."""
    rows = [ln.split("\t") for ln in DATA.read_text().splitlines() if ln and not ln.startswith("#")]
    return [(f, g, n, int(u)) for f, g, n, u in rows]


def name_of(flag: str) -> str:
    return flag[2:].replace("-", "_")


def test_flag_list_is_megatrons_and_the_package_has_the_same():
    head = DATA.read_text().splitlines()[0]
    assert re.match(r"# Megatron-LM \d+\.\d+\.\d+ commit [0-9a-f]{40}", head), head
    rows = megatron_list()
    assert len(rows) > 800 and ("--tensor-model-parallel-size", "transformer configuration", "1") == rows[0][:3]
    package = megatron_flags()
    assert {name_of(f): (g, n) for f, g, n, _ in rows} == {k: (v.group, v.nargs) for k, v in package.items()}


def test_no_megatron_flag_is_unknown_and_refusals_name_the_flag():
    for flag, _, _, _ in megatron_list():
        problem = flag_problem(name_of(flag), "command line")
        if problem is None:
            assert status(name_of(flag))[0] in (IMPLEMENTED, ACCEPTED_STATUS)
            continue
        assert "unknown" not in problem and "did you mean" not in problem, problem
        assert problem.startswith(f"--{name_of(flag).replace('_', '-')} (command line) is a Megatron-LM flag "
                                  "that paratron refuses: "), problem


def test_every_flag_the_scripts_use_has_a_stated_answer():
    """Flags of Megatron's GPT/Llama/MoE scripts: implemented, accepted, or refused for a named reason
    (planned, GPU-only, not applicable), never the catch-all."""
    named = set(REFUSED.values()) | set(GROUP_REASONS.values()) | {r for _, r in PREFIX_REASONS}
    for flag, _, _, uses in megatron_list():
        st, reason = status(name_of(flag))
        assert reason, flag
        if uses and st == REFUSED_STATUS:
            assert reason in named, (flag, reason)
            assert any(w in reason for w in ("planned", "GPU-only", "not applicable")), (flag, reason)


def _readers() -> str:
    skip = {"sections.py", "help.py", "megatron_flags.py", "megatron_reasons.py", "docs.py", "parse.py", "__init__.py",
            "resolution.py"}
    return "\n".join(p.read_text() for p in (ROOT / "paratron").rglob("*.py")
                     if not (p.parent.name == "config" and p.name in skip))


# Fields the code reads through a composed name (the reader named here must exist).
COMPOSED_READS = {"train_data_path": 'f"{name}_data_path"', "valid_data_path": 'f"{name}_data_path"',
                  "test_data_path": 'f"{name}_data_path"',
                  **{f"fim_{role}_token": 'getattr(data, f"fim_{role}_token")'
                     for role in ("prefix", "middle", "suffix", "pad", "eod")}}
# Fields resolve() turns into other fields, or refuses (config/check_*.py read them; the code reads the result).
RESOLVED = {"use_rotary_position_embeddings": "position_embedding_type", "no_position_embedding": "position_embedding_type",
            "recompute_activations": "recompute_granularity", "fp8_hybrid": "fp8_format", "sample_prompt": None,
            "ckpt_format": None}


def test_no_silent_flag_every_field_is_read_by_the_code():
    code = _readers()
    for name in FIELD_SECTION:
        if name in HONOURED_FIELDS:
            continue
        if name in COMPOSED_READS:
            assert COMPOSED_READS[name] in code, name
            continue
        if name in RESOLVED:
            validate = "\n".join(p.read_text() for p in (ROOT / "paratron" / "config").glob("check_*.py"))
            assert re.search(rf"\.{name}\b", validate) and (RESOLVED[name] is None or f".{RESOLVED[name]}" in code), name
            continue
        assert re.search(rf"\.{name}\b|[\"']{name}[\"']", code), f"--{name} is parsed but no code reads it"
    for name, reason in {**ACCEPTED, **HONOURED_FIELDS}.items():  # accepted: stated why, a Megatron flag
        assert len(reason) > 20 and name in megatron_flags(), name


def test_help_describes_every_flag_in_megatrons_groups():
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120).stdout
    entries = re.findall(r"^  (--[a-z0-9-]+)(.*)\n((?:   +\S.*\n)*)", out, flags=re.M)
    described = [f for f, rest, more in entries if len((rest.split("  ", 1) + [""])[1].strip() + more.strip()) > 5]
    assert len(entries) > 200 and len(described) >= 0.9 * len(entries), [f for f, *_ in entries if f not in described]
    for group in ("logging:", "checkpointing:", "transformer configuration:", "data and dataloader:", "paratron:"):
        assert f"\n{group}\n" in out, group
    assert "--attention-backend" in out and "docs/megatron_flags.md" in out


def test_docs_megatron_flags_is_current():
    doc = ROOT / "docs" / "megatron_flags.md"
    assert doc.read_text() == megatron_flags_markdown(), "regenerate with: python tools/gen_config_docs.py"


def test_every_problem_of_a_command_line_is_reported_at_once():
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--dsa-indexer-n-heads", "4", "--hiden-size", "64",
                        "--attention-backend", "weird", "--timing-log-level", "7", "--hidden-size", "66",
                        "--dist-ckpt-strictness", "log_all", "--use-flash-attn"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    err = r.stderr
    for needle in ("5 problems",
                   "--dsa-indexer-n-heads (command line) is a Megatron-LM flag that paratron refuses: planned",
                   "unknown flag --hiden-size", "did you mean --hidden-size", "--attention-backend weird",
                   "--timing-log-level must be 0, 1 or 2", "--hidden-size 66 is not divisible"):
        assert needle in err, (needle, err)


def test_accepted_flags_parse_in_yaml_and_command_line(tmp_path):
    (tmp_path / "a.yaml").write_text("transformer_impl: local\nuse_persistent_ckpt_worker: true\n")
    cfg = parse_args(BASE + ["--config", str(tmp_path / "a.yaml"), "--attention-backend", "auto", "--no-rope-fusion",
                             "--dist-ckpt-optim-fully-reshardable", "--ckpt-format", "torch_dist"])
    assert cfg.ckpt.ckpt_format == "torch_dist"
    (tmp_path / "b.yaml").write_text("transformer_impl: inference_optimized\ndsa_indexer_n_heads: 8\n")
    with pytest.raises(ConfigError, match="2 problems.*transformer-impl inference_optimized.*--dsa-indexer-n-heads"):
        parse_args(BASE + ["--config", str(tmp_path / "b.yaml")])


def test_megatron_semantics_of_tokenizer_position_and_split(tmp_path):
    vocab, merges = _gpt2_files(tmp_path)
    cfg = parse_args(BASE + ["--vocab-file", str(vocab), "--merge-file", str(merges)])
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"  # Megatron's default, with --mock-data too
    with pytest.raises(ConfigError, match="read only by GPT2BPETokenizer"):
        parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--vocab-file", str(vocab)])
    rope = parse_args(BASE + ["--use-rotary-position-embeddings", "--no-position-embedding"])
    assert rope.model.position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="--no-position-embedding with --position-embedding-type learned_absolute"):
        parse_args(BASE + ["--no-position-embedding"])


def _gpt2_files(tmp_path):
    import json
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyzĠ")}}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return tmp_path / "vocab.json", tmp_path / "merges.txt"


def test_split_applies_to_mock_data():
    from paratron.data import build_tokenizer
    from paratron.data.blended import build_train_valid_test_datasets
    cfg = parse_args(BASE + ["--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--split", "100,0,0",
                             "--seq-length", "16", "--max-position-embeddings", "16"])
    train, valid, test = build_train_valid_test_datasets(cfg.data, build_tokenizer(cfg.data), 16, 1, [8, 8, 8])
    assert train is not None and valid is None and test is None


@pytest.mark.parametrize("flags,message", [
    (["--dataloader-type", "random"], "--dataloader-type must be single or cyclic"),
    (["--exp-avg-dtype", "bf16"], "needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], "paratron keeps the master weights in fp32"),
    (["--batch-size", "4"], "use --micro-batch-size"),
    (["--sgd-momentum", "0.9"], "--optimizer sgd, which paratron refuses"),
    (["--lion-beta2", "0.9"], "--optimizer lion, which paratron refuses"),
])
def test_megatron_values_paratron_has_are_accepted_the_others_say_why(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + flags)
    cfg = parse_args(BASE + ["--dataloader-type", "cyclic", "--main-grads-dtype", "fp32", "--main-params-dtype", "fp32",
                             "--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype", "fp32"])
    assert cfg.train.micro_batch_size >= 1
