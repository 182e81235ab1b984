"""One range table for every numeric flag (paratron/config/ranges.py): each violation is one line,
``--FLAG must be ... (got X)``, exit code 2, from the command line, YAML and presets alike, before
anything is built; a fraction for an integer flag is refused, not truncated."""
import dataclasses

import pytest

from paratron.cli import main
from paratron.config import SECTIONS, Config, ConfigError, apply_dict, parse_args, resolve
from paratron.config.ranges import RANGES, numeric_fields, range_problem
from paratron.config.sections import FIELD_TYPES, base_type, flag

TINY = ["--config", "tiny", "--train-iters", "2", "--eval-iters", "0", "--device", "cpu"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paratron: error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("flags,message", [
    (["--init-method-std", "-1"], "--init-method-std must be > 0 (got -1.0)"),
    (["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1) (got 2.0)"),
    (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1) (got 1.5)"),
    (["--adam-eps", "-1e-8"], "--adam-eps must be > 0 (got -1e-08)"),
    (["--train-iters", "-5"], "--train-iters must be >= 0 (got -5)"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0 (got -1.0)"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0 (got -1.0)"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0 (got -1)"),
    (["--hidden-dropout", "1"], "--hidden-dropout must be in [0, 1) (got 1.0)"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0 (got 0.0)"),
])
def test_issue_cases_are_one_line_errors_with_exit_2(capsys, flags, message):
    assert main(["train", *TINY, *flags]) == 2
    assert one_error_line(capsys) == f"paratron: error: {message}"


def test_yaml_fraction_for_an_integer_is_refused_not_truncated(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train_iters: 2.5\n")
    assert main(["train", "--config", str(f), "--lr", "1e-3", "--mock-data"]) == 2
    assert one_error_line(capsys) == "paratron: error: --train-iters must be an integer (got 2.5)"
    f.write_text("train_iters: 3.0\n")  # an integral float is the integer
    assert parse_args(["--config", str(f), "--lr", "1e-3", "--mock-data"]).train.train_iters == 3


def test_yaml_and_presets_go_through_the_same_table(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("adam_beta1: 2.0\nlr: 1.0e-3\nmock_data: true\ntrain_iters: 2\n")
    with pytest.raises(ConfigError, match=r"^--adam-beta1 must be in \[0, 1\) \(got 2.0\)$"):
        parse_args(["--config", str(f)])
    with pytest.raises(ConfigError, match=r"^--weight-decay must be >= 0"):  # a preset, then a bad override
        parse_args(["--config", "gpt-125m", "--weight-decay", "-0.1"])


def test_every_numeric_field_has_a_range_and_its_default_is_in_it():
    missing = [flag(n) for n in numeric_fields() if n not in RANGES]
    assert not missing, f"add these flags to paratron/config/ranges.py RANGES: {missing}"
    assert set(RANGES) <= set(numeric_fields()), set(RANGES) - set(numeric_fields())
    for sec in SECTIONS.values():
        for f in dataclasses.fields(sec):
            if f.name in RANGES:
                assert range_problem(f.name, f.default) is None, f.name


def _outside(name: str):
    """A value just outside the field's range (None where the range has no such side)."""
    rule, integer = RANGES[name], base_type(FIELD_TYPES[name]) is int
    if rule.low is None and rule.high is None:  # unbounded but finite
        return float("inf")
    if rule.low is not None:
        value = rule.low - (1 if integer else 0.5) if rule.low_inclusive else rule.low
    else:
        value = rule.high if not rule.high_inclusive else rule.high + 0.5
    return int(value) if integer else float(value)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_each_table_entry_is_enforced_by_resolve(name):
    cfg = Config()
    apply_dict(cfg, {"lr": 1e-3, "train_iters": 2, "mock_data": True}, "test")
    cfg.set(name, _outside(name))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=1)
    assert str(e.value).startswith(f"{flag(name)} must be {RANGES[name].text} (got "), str(e.value)
    rule = RANGES[name]
    if rule.high is not None:  # the upper side too
        cfg = Config()
        apply_dict(cfg, {"lr": 1e-3, "train_iters": 2, "mock_data": True}, "test")
        cfg.set(name, rule.high + (0.5 if rule.high_inclusive else 0.0))
        with pytest.raises(ConfigError, match=f"^{flag(name)} must be"):
            resolve(cfg, world_size=1)


def test_an_integer_field_set_in_python_to_a_fraction_is_refused():
    cfg = Config()
    apply_dict(cfg, {"lr": 1e-3, "train_iters": 2, "mock_data": True}, "test")
    cfg.train.train_iters = 2.5
    with pytest.raises(ConfigError, match=r"^--train-iters must be an integer \(got 2.5\)$"):
        resolve(cfg, world_size=1)
