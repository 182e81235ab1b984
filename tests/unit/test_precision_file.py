"""--te-precision-config-file (config/precision_file.py, fp8/linear.attach): Megatron's per-module precision file read
and checked, each problem one line naming it; the matchers choose each layer's precision by its Megatron name; a
file that keeps every layer in bf16 trains exactly as the run without FP8; an experts-only file runs the routed
experts alone in FP8 (CPU standing in for an FP8 GPU, as tests/unit/test_fp8.py does)."""
import pytest
import torch

from paratron import fp8
from paratron.config import parse_args
from paratron.config.precision_file import Rule, first_match, read_rules
from paratron.errors import ConfigError
from paratron.fp8.linear import megatron_name
from paratron.fp8.recipe import Recipe

BF16 = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}


def fp8_config(recipe):
    return {"transformer_engine_config_type": "TEQuantizationParams",
            "training_recipe": {"fp8_quantization_recipe": recipe}}


def glob(pattern, config, enabled=True):
    return {"type": "glob", "pattern": pattern, "config": config, "enabled": enabled}


def write(tmp_path, doc, name="precision.yaml"):
    import yaml
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_matchers_are_read_in_order_and_the_first_enabled_match_wins(tmp_path):
    path = write(tmp_path, {"configs": {"bf16": BF16, "block": fp8_config("blockwise")},
                            "matchers": {"qkv_off": glob("*.linear_qkv", "bf16", enabled=False),
                                         "experts_block": glob("*.mlp.experts.*", "block"),
                                         "attn_bf16": glob("*.self_attention.*", "bf16"),
                                         "all_bf16": glob("*", "bf16")}})
    rules = read_rules(path)
    assert rules == (Rule("experts_block", "*.mlp.experts.*", "blockwise"),
                     Rule("attn_bf16", "*.self_attention.*", None), Rule("all_bf16", "*", None))
    assert first_match(rules, "decoder.layers.3.mlp.experts.linear_fc1").matcher == "experts_block"
    assert first_match(rules, "decoder.layers.3.self_attention.linear_qkv").matcher == "attn_bf16"
    assert first_match(rules, "decoder.layers.3.mlp.linear_fc1").matcher == "all_bf16"
    assert first_match(rules[:2], "decoder.layers.3.mlp.linear_fc1") is None


@pytest.mark.parametrize("doc, says", [
    ({"configs": {"bf16": BF16}}, "two mappings, configs and matchers"),
    ({"configs": {"x": {"transformer_engine_config_type": "Other", "training_recipe": {}}}, "matchers": {}},
     "transformer_engine_config_type must be TEQuantizationParams"),
    ({"configs": {"x": fp8_config("mxfp8")}, "matchers": {}}, "mxfp8 is not supported: mxfp8"),
    ({"configs": {"x": fp8_config("current")}, "matchers": {}}, "must be one of tensorwise, delayed, blockwise"),
    ({"configs": {"x": {"transformer_engine_config_type": "TEQuantizationParams",
                        "training_recipe": {"fp4_quantization_recipe": "nvfp4"}}}, "matchers": {}},
     "fp4_quantization_recipe is not supported: paratron has no FP4"),
    ({"configs": {"x": {**fp8_config("tensorwise"), "evaluation_recipe": {}}}, "matchers": {}},
     "evaluation_recipe other than its training_recipe is not implemented"),
    ({"configs": {"bf16": BF16}, "matchers": {"m": {"type": "regex", "pattern": "x", "config": "bf16"}}},
     "matchers.m: type must be glob"),
    ({"configs": {"bf16": BF16}, "matchers": {"m": glob("*", "fp8")}}, "config 'fp8' is not one of configs (bf16)"),
    ({"configs": {"bf16": BF16}, "matchers": {"m": glob("", "bf16")}}, "pattern must be a glob"),
    ({"configs": {"bf16": BF16}, "matchers": {"m": {**glob("*", "bf16"), "priority": 1}}}, "unknown key 'priority'"),
    ({"configs": {"bf16": BF16}, "matchers": {"m": glob("*", "bf16", enabled="yes")}}, "enabled must be true or false"),
])
def test_a_bad_file_is_one_line_naming_the_problem(tmp_path, doc, says):
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as e:
        read_rules(path)
    assert says in str(e.value) and str(e.value).startswith(f"--te-precision-config-file {path}: ")
    assert "\n" not in str(e.value)


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it .* give the path of the YAML file"):
        read_rules(str(tmp_path / "absent.yaml"))
    (tmp_path / "bad.yaml").write_text("configs: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_rules(str(tmp_path / "bad.yaml"))


BASE = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--bf16", "--lr", "1e-3"]


def test_the_flag_is_checked_with_the_run(tmp_path):
    path = write(tmp_path, {"configs": {"block": fp8_config("blockwise")},
                            "matchers": {"experts": glob("*.experts.*", "block")}})
    with pytest.raises(ConfigError, match="has no effect without it; add --fp8-format"):
        parse_args(BASE + ["--te-precision-config-file", path])
    with pytest.raises(ConfigError, match="the blockwise recipe of --te-precision-config-file keeps every tensor in "
                                          "e4m3"):
        parse_args(BASE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--te-precision-config-file", path])
    cfg = parse_args(BASE + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--te-precision-config-file", path])
    assert cfg.train.te_precision_config_file == path
    with pytest.raises(ConfigError, match="with the blockwise recipe of --te-precision-config-file needs FP8 GEMM "
                                          "sizes that are multiples of 128; --hidden-size is 64"):
        parse_args(BASE + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--te-precision-config-file", path,
                           "--hidden-size", "64"])
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_args(BASE + ["--fp8-format", "e4m3", "--te-precision-config-file", str(tmp_path / "gone.yaml")])


def test_layers_are_named_as_megatron_names_them_with_global_layer_numbers():
    class Layer:
        def __init__(self, index):
            self.index = index
    stage = [Layer(4), Layer(5)]  # the second pipeline stage of a 6-layer model
    assert megatron_name("layers.1.self_attention.linear_qkv", "decoder", stage) == \
        "decoder.layers.5.self_attention.linear_qkv"
    assert megatron_name("layers.0.mtp_model_layer.mlp.linear_fc1", "mtp", None) == \
        "mtp.layers.0.mtp_model_layer.mlp.linear_fc1"


def test_attach_follows_the_matchers_on_an_moe_model(tmp_path):
    from paratron.config.sections import ModelConfig
    from paratron.model.gpt import GPTModel
    path = write(tmp_path, {"configs": {"bf16": BF16, "block": fp8_config("blockwise")},
                            "matchers": {"experts": glob("*.mlp.experts.*", "block"),
                                         "second_layer_attention": glob("decoder.layers.1.self_attention.*", "bf16")}})
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=128,
                      moe_shared_expert_intermediate_size=128, seq_length=128, max_position_embeddings=128).resolved()
    recipe = Recipe(format="e4m3", recipe="tensorwise", emulate=True, overrides=read_rules(path))
    model = GPTModel(cfg, 256, fp8=recipe)
    states = {n: m.fp8 for n, m in model.named_modules() if hasattr(m, "fp8") and n.rsplit(".", 1)[-1] in fp8.LAYERS}
    assert states["decoder.layers.1.self_attention.linear_qkv"] is None
    assert states["decoder.layers.1.self_attention.linear_proj"] is None
    assert states["decoder.layers.0.self_attention.linear_qkv"].recipe.recipe == "tensorwise"
    assert states["decoder.layers.0.mlp.shared_experts.linear_fc1"].recipe.recipe == "tensorwise"
    experts = [f"decoder.layers.{i}.mlp.experts.linear_{f}" for i in (0, 1) for f in ("fc1", "fc2")]
    assert {states[name].recipe.recipe for name in experts} == {"blockwise"}
    assert fp8.coverage([model]) == ("FP8 linears: 6 tensorwise, 4 blockwise; in the parameters' dtype: 2 "
                                     "(--te-precision-config-file matchers: experts 4, second_layer_attention 2)")


def _trainer_losses(flags, steps, capsys):
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    trainer = Trainer(parse_args(TINY + ["--train-iters", str(steps), "--device", "cpu", "--bf16"] + flags))
    return trainer, losses_of(trainer, steps), capsys.readouterr().out


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-shared-expert-intermediate-size", "32", "--moe-grouped-gemm"]


def test_a_file_keeping_every_layer_in_bf16_trains_as_the_run_without_fp8(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    path = write(tmp_path, {"configs": {"bf16": BF16}, "matchers": {"everything": glob("*", "bf16")}})
    _, plain, _ = _trainer_losses(MOE, 3, capsys)
    trainer, kept, out = _trainer_losses(MOE + ["--fp8-format", "hybrid", "--te-precision-config-file", path], 3,
                                         capsys)
    assert kept == plain
    assert "FP8 linears: none; in the parameters' dtype: 12 (--te-precision-config-file matchers: everything 12)" \
        in out, out
    assert not any(getattr(m, "fp8", None) is not None for m in trainer.model.modules())


def test_an_experts_only_file_runs_the_routed_experts_alone_in_fp8(tmp_path, monkeypatch, capsys):
    """torchtitan's MoE float8 in Megatron's terms: attention and the shared expert kept in bf16 by matchers."""
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    path = write(tmp_path, {"configs": {"bf16": BF16}, "matchers": {"attention": glob("*.self_attention.*", "bf16"),
                                                                   "shared": glob("*.shared_experts.*", "bf16")}})
    _, plain, _ = _trainer_losses(MOE, 2, capsys)
    trainer, losses, out = _trainer_losses(MOE + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                                                  "--te-precision-config-file", path], 2, capsys)
    with_state = sorted(n.removeprefix("module.") for n, m in trainer.model.named_modules()
                        if getattr(m, "fp8", None) is not None)
    assert with_state == [f"decoder.layers.{i}.mlp.experts.linear_{f}" for i in (0, 1) for f in ("fc1", "fc2")]
    assert "FP8 linears: 4 tensorwise; in the parameters' dtype: 8 (--te-precision-config-file matchers: " \
           "attention 4, shared 4)" in out, out
    assert losses != plain and all(abs(a - b) < 0.05 * abs(b) for a, b in zip(losses, plain)), (losses, plain)


@pytest.mark.parametrize("fc1, fc2", [("tensorwise", "blockwise"), ("blockwise", "tensorwise"), (None, "tensorwise"),
                                      ("tensorwise", None)])
def test_experts_with_two_precisions_align_their_rows_for_both(fc1, fc2):
    """fc1 and fc2 of the routed experts in two recipes (or one in bf16): the grouped layout, its rows aligned for
    the stricter recipe (128 when either is blockwise: a tile along the rows never holds two experts), and the layer
    close to its bf16 self."""
    from paratron.model.layers import Parallel
    from paratron.model.moe import MoELayer
    cfg = parse_args(["--mock-data", "--train-iters", "1", "--lr", "1e-3", "--num-layers", "1", "--hidden-size", "128",
                      "--num-attention-heads", "2", "--seq-length", "16", "--num-experts", "4", "--moe-router-topk",
                      "2", "--moe-ffn-hidden-size", "128", "--swiglu", "--disable-bias-linear"]).model
    torch.manual_seed(0)
    layer = MoELayer(cfg, Parallel())
    x = torch.randn(16, 2, 128)
    ref = layer(x)
    rules = tuple(Rule(f"fc{i}", f"*.experts.linear_fc{i}", r) for i, r in ((1, fc1), (2, fc2)))
    run = [r for r in (fc1, fc2) if r is not None][0]
    fp8.attach(layer, Recipe(format="e4m3", recipe=run, emulate=True, overrides=rules))
    states = [layer.experts.linear_fc1.fp8, layer.experts.linear_fc2.fp8]
    assert [s.recipe.recipe if s is not None else None for s in states] == [fc1, fc2]
    assert layer.experts.row_alignment() == (128 if "blockwise" in (fc1, fc2) else 16)
    out = layer(x)
    assert layer.experts.used_grouped_mm
    assert 0 < (out - ref).norm() / ref.norm() < 0.1
