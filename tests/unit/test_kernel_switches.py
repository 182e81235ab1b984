"""The kernel switches record (config/kernels.py, kernels/switches.py): flags and YAML keys (their one-line
errors: tests/unit/test_config.py), ``auto`` resolved to what runs on the device, the start-up lines, and the checkpoint's saved config."""
import json

import pytest
import torch

from paratron.config import KernelConfig, build_parser, parse_args
from paratron.kernels import switches

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--lr", "1e-3", "--num-workers", "0",
        "--eval-iters", "0", "--train-iters", "1"]


def test_flags_and_yaml_keys_set_the_switches(tmp_path):
    cfg = parse_args(TINY + ["--kernel-cublaslt", "off", "--attention-backend", "flash", "--no-rope-fusion"])
    k = cfg.kernels
    assert (k.kernel_cublaslt, k.attention_backend, k.no_rope_fusion) == ("off", "flash", True)
    yaml_file = tmp_path / "k.yaml"
    yaml_file.write_text("kernels:\n  kernel_rmsnorm: torch\n  kernel_quack_tiles: dx=256x128c1x2coop\n")
    k = parse_args(["--config", str(yaml_file)] + TINY).kernels
    assert k.kernel_rmsnorm == "torch" and k.kernel_quack_tiles == "dx=256x128c1x2coop"
    assert "--kernel-cublaslt" in build_parser().format_help()


def test_auto_resolves_to_the_plain_paths_on_a_cpu_and_an_explicit_choice_stays():
    runs = switches.resolve(KernelConfig(), "cpu", torch.float32)
    assert runs.attention_backend == "unfused" and runs.kernel_gated_mlp == "torch"
    assert runs.kernel_cublaslt == "off" and runs.kernel_cross_entropy == "compiled" and runs.no_rope_fusion
    asked = KernelConfig(kernel_gated_mlp="quack", kernel_fp8_grad_cast="off")
    runs = switches.resolve(asked, "cpu", torch.float32)
    assert runs.kernel_gated_mlp == "quack" and runs.kernel_fp8_grad_cast == "off"


def test_start_up_lines_and_the_checkpoint_config_say_what_ran(tmp_path, capsys):
    from paratron.checkpoint import sharded
    from paratron.train.loop import Trainer
    root = tmp_path / "ck"
    t = Trainer(parse_args(TINY + ["--save", str(root), "--kernel-rmsnorm", "torch"]), data=(iter(()), None))
    t._announce()
    t.save()
    t.close()
    out = capsys.readouterr().out
    assert "kernel switches" in out and "--kernel-cublaslt auto -> off" in out and "--kernel-rmsnorm torch\n" in out
    saved = sharded.read_common(sharded.iter_dir(str(root), 0))["config"]["kernels"]
    assert saved["kernel_cublaslt"] == "off" and saved["attention_backend"] == "unfused"  # what ran, not "auto"
    assert saved["kernel_rmsnorm"] == "torch"
    assert t.cfg.kernels.unfrozen().kernel_cublaslt == "auto"  # the value as asked is kept
    json.dumps(saved)  # plain values


@pytest.mark.parametrize("version,capability,tilelang,refused", [
    ("3.6.0", (9, 0), False, True), ("3.4.0", (9, 0), False, True), ("3.7.1", (9, 0), False, False),
    ("3.3.1", (9, 0), False, False), ("3.6.0", (8, 0), False, False), ("3.6.0", (9, 0), True, False)])
def test_fla_refusal_follows_fla_cores_own_check(monkeypatch, version, capability, tilelang, refused):
    """fla-core 0.6 refuses its gated backward on Hopper with Triton in [3.4.0, 3.7.1) unless tilelang is
    installed; the switch knows it before a run starts (auto takes torch, an explicit fla is refused)."""
    import importlib.util
    import sys
    import types

    from paratron.config.kernels import KernelConfig
    from paratron.errors import ConfigError
    from paratron.kernels import linear_scan, switches
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("triton", "fla") or (name == "tilelang" and tilelang)
                        else None if name == "tilelang" else real(name, *a))
    reason = linear_scan.fla_refusal()
    assert (reason is not None) == refused
    if refused:
        assert version in reason and "--kernel-linear-scan torch" in reason
        with pytest.raises(ConfigError, match="--kernel-linear-scan fla"):
            switches.resolve(KernelConfig(kernel_linear_scan="fla"), "cuda", torch.bfloat16)
        assert switches._linear_scan("cuda")[0] == "torch"
    else:
        assert switches._linear_scan("cuda")[0] == "fla"
