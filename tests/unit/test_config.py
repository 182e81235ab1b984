import pytest

from paratron.config import Config, ConfigError, apply_dict, parse_args, reference_markdown

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "5", "--lr", "1e-3", "--mock-data"]


def test_flags_map_to_megatron_named_fields():
    cfg = parse_args(BASE + ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                             "--num-query-groups", "2"])
    assert cfg.model.hidden_size == 64 and cfg.model.swiglu and cfg.model.num_query_groups == 2
    assert cfg.model.kv_channels == 16
    assert cfg.model.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
    assert cfg.flat().num_layers == 2


def test_misspelt_flag_names_it_and_suggests():
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + ["--hiden-size", "64"])
    msg = str(e.value)
    assert "--hiden-size" in msg and "--hidden-size" in msg and "\n" not in msg


def test_unsupported_megatron_flag_is_named():
    with pytest.raises(ConfigError, match="--tp-comm-overlap.*refuses: GPU-only"):  # (--num-experts exists now)
        parse_args(BASE + ["--tp-comm-overlap"])


@pytest.mark.parametrize("extra,needle", [
    (["--hidden-size", "66"], "not divisible by --num-attention-heads"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
    (["--lr-decay-style", "exp"], "--lr-decay-style"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], "exceeds --max-position-embeddings"),
    (["--hidden-size", "abc"], "invalid int value"),
    (["--kernel-cublaslt", "maybe"], "--kernel-cublaslt maybe: choose one of auto, on, off"),
    (["--attention-backend", "xformers"], "--attention-backend xformers: choose one of"),
    (["--kernel-quack-tiles", "dx=big"], "--kernel-quack-tiles dx=big"),
    (["--kernel-quack-tiles", "qkv=256x128c1x2coop"], "is not <dgated|dx|wgrad_fc1|wgrad_fc2>"),
])
def test_validation_errors_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_essentials():
    with pytest.raises(ConfigError, match="--train-iters"):
        parse_args(["--lr", "1", "--mock-data"])
    with pytest.raises(ConfigError, match="--lr"):
        parse_args(["--train-iters", "1", "--mock-data"])
    with pytest.raises(ConfigError, match="no training data"):
        parse_args(["--train-iters", "1", "--lr", "1"])


def test_yaml_flat_and_sectioned_then_flags_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  hidden_size: 128\n  num_attention_heads: 8\nnum_layers: 3\nlr: 2.0e-4\n"
                 "train_iters: 7\nmock_data: true\n")
    cfg = parse_args(["--config", str(f), "--num-layers", "5"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.optim.lr, cfg.train.train_iters) == (128, 5, 2e-4, 7)
    f.write_text("hiden_size: 3\n")
    with pytest.raises(ConfigError, match="did you mean --hidden-size"):
        parse_args(["--config", str(f)])
    f.write_text("hidden_size: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_args(["--config", str(f)])


@pytest.mark.parametrize("preset", ["tiny", "gpt-125m", "gpt-350m", "llama-1b"])
def test_presets_load(preset):
    cfg = parse_args(["--config", preset])
    assert cfg.model.num_layers >= 2


def test_llama_preset_shape():
    cfg = parse_args(["--config", "llama-1b"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.ffn_hidden_size) == (16, 2048, 8, 8192)
    assert cfg.padded_vocab_size == 32768


def test_vocab_padding_follows_megatron():
    cfg = Config()
    cfg.data.vocab_size = 50257
    assert cfg.padded_vocab_size == 50304
    cfg.parallel.tensor_model_parallel_size = 8
    assert cfg.padded_vocab_size == 51200  # multiple of 128 x TP


def test_apply_dict_type_errors():
    with pytest.raises(ConfigError, match="hidden_size: expected int"):
        apply_dict(Config(), {"hidden_size": "big"}, "test")


def test_reference_lists_every_field():
    md = reference_markdown()
    for name in ("--tensor-model-parallel-size", "--lr-decay-style", "--data-path", "--save-interval"):
        assert name in md


def test_docs_config_reference_is_current():
    from pathlib import Path
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == reference_markdown(), "regenerate with: python tools/gen_config_docs.py"


def test_data_path_on_the_command_line_replaces_preset_mock_data():
    cfg = parse_args(["--config", "tiny", "--data-path", "some/prefix"])
    assert not cfg.data.mock_data and cfg.data.data_path == ["some/prefix"]


def test_data_path_files_give_the_blends(tmp_path):
    """Megatron's --data-args-path (--data-path's values in a file) and --per-split-data-args-path (JSON, one blend
    per split, lists or strings); conflicting or unreadable inputs are one line each."""
    import json
    args = tmp_path / "data.txt"
    args.write_text("0.3 corpus/a_text_document\n0.7 corpus/b_text_document\n")
    cfg = parse_args(["--config", "tiny", "--data-args-path", str(args)])
    assert cfg.data.data_path == ["0.3", "corpus/a_text_document", "0.7", "corpus/b_text_document"]
    assert not cfg.data.mock_data
    from paratron.config import resolve
    again = resolve(cfg.unfrozen())  # checked again: the same paths
    assert again.data.data_path == cfg.data.data_path
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": ["1", "t/a", "2", "t/b"], "valid": "v/a", "test": None}))
    cfg = parse_args(["--config", "tiny", "--per-split-data-args-path", str(splits)])
    d = cfg.data
    assert (d.train_data_path, d.valid_data_path, d.test_data_path, d.data_path) == (["1", "t/a", "2", "t/b"],
                                                                                     ["v/a"], None, None)
    (tmp_path / "bad.json").write_text("{train: 1")
    (tmp_path / "empty.txt").write_text(" \n")
    for flags, message in ((["--data-args-path", str(args), "--data-path", "x"], "both give the data"),
                           (["--data-args-path", str(tmp_path / "none.txt")], "cannot read it"),
                           (["--data-args-path", str(tmp_path / "empty.txt")], "is empty"),
                           (["--per-split-data-args-path", str(tmp_path / "bad.json")], "not JSON"),
                           (["--per-split-data-args-path", str(splits), "--train-data-path", "x"],
                            "remove --data-path"),
                           (["--per-split-data-args-path", str(args)], "not JSON")):
        with pytest.raises(ConfigError, match=message) as err:
            parse_args(["--config", "tiny", *flags])
        assert "\n" not in str(err.value)


def test_ddp_num_buckets_and_padding_lay_out_the_buckets():
    """--ddp-num-buckets N cuts this rank's parameters into N buckets (Megatron's sizing); with
    --ddp-pad-buckets-for-high-nccl-busbw every bucket's size is a multiple of 2^16 too; training is unchanged."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    runs = {}
    for name, extra in (("plain", []), ("four", ["--ddp-num-buckets", "4"]),
                        ("padded", ["--ddp-num-buckets", "4", "--ddp-pad-buckets-for-high-nccl-busbw"])):
        t = Trainer(parse_args(TINY + ["--train-iters", "3", "--device", "cpu"] + extra))
        runs[name] = ([b.numel for buf in t.model.grad_buffers for b in buf.buckets], losses_of(t, 3))
    total = sum(runs["plain"][0])
    assert len(runs["plain"][0]) == 1 and len(runs["four"][0]) == 4 and len(runs["padded"][0]) == 4
    assert max(runs["four"][0]) <= total // 4 + 4096  # a bucket closes at the first parameter past N-th of them
    assert all(n % 2 ** 16 == 0 for n in runs["padded"][0]) and not all(n % 2 ** 16 == 0 for n in runs["four"][0])
    assert runs["plain"][1] == runs["four"][1] == runs["padded"][1]
    with pytest.raises(ConfigError, match="--ddp-num-buckets and --ddp-bucket-size both size"):
        parse_args(BASE + ["--ddp-num-buckets", "2", "--ddp-bucket-size", "1000"])


def test_boolean_flag_takes_an_optional_value_to_turn_off_a_yaml_setting():
    from paratron.config import ConfigError, parse_args
    assert parse_args(["--config", "llama-1b"]).train.bf16 is True
    assert parse_args(["--config", "llama-1b", "--bf16", "false"]).train.bf16 is False
    assert parse_args(["--config", "llama-1b", "--bf16=off"]).train.bf16 is False
    cfg = parse_args(["--config", "tiny", "--bf16", "--train-iters", "3"])  # Megatron's bare form
    assert cfg.train.bf16 is True and cfg.train.train_iters == 3
    with pytest.raises(ConfigError, match="expected true or false"):
        parse_args(["--config", "tiny", "--bf16", "maybe"])


# ---- resolved once, then frozen -----------------------------------------------------------------
def test_writing_after_resolve_raises_naming_the_field():
    from paratron.config import FrozenConfigError, ModelConfig
    cfg = parse_args(BASE)
    for write, field in ((lambda: setattr(cfg.optim, "lr", 1.0), "optim.lr (--lr)"),
                         (lambda: setattr(cfg.train, "lr", 1.0), "train.lr"),
                         (lambda: setattr(cfg.train, "global_batch_size", 64), "train.global_batch_size"),
                         (lambda: cfg.set("hidden_size", 128), "model.hidden_size"),
                         (lambda: setattr(cfg, "model", ModelConfig()), "config.model")):
        with pytest.raises(FrozenConfigError) as e:
            write()
        msg = str(e.value)
        assert field in msg and "frozen" in msg and "\n" not in msg, msg
        assert isinstance(e.value, ConfigError)
    assert cfg.optim.lr == 1e-3 and cfg.model.hidden_size == 64
    listed = parse_args(BASE[:-1] + ["--data-path", "a", "b", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"])
    with pytest.raises(FrozenConfigError):
        listed.data.data_path.append("c")  # list fields are frozen too
    assert listed.data.data_path == ["a", "b"] and listed.unfrozen().data.data_path + ["c"] == ["a", "b", "c"]


def test_a_modified_copy_is_resolved_again_from_the_values_as_given():
    import dataclasses
    from paratron.config import resolve
    cfg = parse_args(BASE)
    assert cfg.model.kv_channels == 16 and cfg.is_resolved
    copy = cfg.unfrozen()
    assert not copy.is_resolved and copy.model.kv_channels is None  # derived values are recomputed
    copy.model.hidden_size = 128
    copy.optim.lr = 2e-3
    resolve(copy)
    assert (copy.model.kv_channels, copy.model.ffn_hidden_size, copy.optim.lr) == (32, 512, 2e-3)
    assert (cfg.model.kv_channels, cfg.model.hidden_size, cfg.optim.lr) == (16, 64, 1e-3)  # original untouched
    assert dataclasses.replace(cfg.optim, lr=5.0).lr == 5.0 and cfg.optim.lr == 1e-3


def test_resolve_derives_batch_iterations_and_vocab_from_the_world_size():
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--lr", "1e-3", "--mock-data",
             "--train-samples", "100", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2"]
    cfg = parse_args(flags, world_size=8)
    assert cfg.world_size == 8 and cfg.data_parallel_size == 4
    assert cfg.train.global_batch_size == 8  # micro-batch 2 x data-parallel 4
    assert cfg.train.train_iters == 12  # 100 samples // 8
    assert cfg.data.tokenizer_type == "NullTokenizer" and cfg.data.vocab_size == 50257  # mock data's default
    with pytest.raises(ConfigError, match="world size 3 is not divisible by TP 2"):
        parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=3)


def test_a_failed_resolve_leaves_the_config_as_given():
    from paratron.config import resolve
    cfg = Config()
    cfg.train.train_iters, cfg.optim.lr, cfg.data.mock_data = 2, 1e-3, True
    cfg.train.bf16 = cfg.train.fp16 = True
    with pytest.raises(ConfigError, match="mutually exclusive"):
        resolve(cfg)
    assert not cfg.is_resolved and cfg.model.kv_channels is None and cfg.data.tokenizer_type is None
    cfg.train.fp16 = False
    assert resolve(cfg).model.kv_channels == 16


def test_model_config_alone_is_resolved_as_a_copy():
    import torch
    from paratron.config import ModelConfig
    from paratron.model.gpt import GPTModel
    m = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)
    r = m.resolved()
    assert r is not m and r.is_resolved and (r.kv_channels, r.max_position_embeddings) == (8, 16)
    assert r.resolved() is r
    torch.manual_seed(0)
    model = GPTModel(m.resolved(max_position_embeddings=8, seq_length=8), 64, max_sequence_length=8)
    assert model.config.max_position_embeddings == 8 and model.config.seq_length == 8
    assert not m.is_resolved and m.kv_channels is None and m.max_position_embeddings is None and m.seq_length == 16
    cfg = parse_args(BASE)
    assert GPTModel(cfg.model, 128).config is cfg.model  # a resolved config is used as it is


def test_trainer_needs_a_config_resolved_for_its_world():
    from paratron.config import check_resolved
    cfg = parse_args(BASE, world_size=2)
    with pytest.raises(ConfigError, match="resolved for world size 2 but this run has 1"):
        check_resolved(cfg, 1)
    with pytest.raises(ConfigError, match="not resolved"):
        check_resolved(Config(), 1)


def test_presets_ship_inside_the_package():
    from pathlib import Path
    import paratron
    from paratron.config import PRESET_DIR, presets
    assert PRESET_DIR == Path(paratron.__file__).resolve().parent / "configs"
    assert {"tiny", "gpt-125m", "gpt-350m", "llama-1b"} <= set(presets())
    root = Path(__file__).resolve().parents[2]
    assert (root / "configs" / "tiny.yaml").read_text() == (PRESET_DIR / "tiny.yaml").read_text()  # docs' path
    cfg = parse_args(["--config", str(root / "configs" / "tiny.yaml")])
    assert cfg.model.hidden_size == 64


def test_package_keeps_files_and_functions_small():
    import ast
    from pathlib import Path
    import paratron
    for path in Path(paratron.__file__).parent.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) < 500, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.name}: {node.name}"


@pytest.mark.parametrize("words,kind", [(["allgather"], "allgather"), (["a2a", "a2a", "a2a"], "a2a"),
                                        (["p2p", "a2a"], "p2p a2a")])
def test_cp_comm_type_takes_megatron_per_layer_lists(words, kind):
    """Megatron's --cp-comm-type is one type for all layers or a list, one type per layer (the model's two)."""
    assert parse_args(BASE + ["--cp-comm-type", *words]).parallel.cp_comm_type == kind


def test_per_layer_cp_comm_types_pick_each_layers_kind():
    from paratron.parallel.context import ContextParallel
    cp = ContextParallel(None, 2, 0, "p2p a2a+p2p allgather")
    assert [cp.kind(i) for i in (0, 1, 2, 5, None)] == ["p2p", "a2a+p2p", "allgather", "allgather", "p2p"]
    assert ContextParallel(None, 2, 0, "a2a").kind(7) == "a2a"


def test_padded_vocab_size_is_taken_as_given_and_checked():
    cfg = parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--padded-vocab-size", "520"])
    assert cfg.padded_vocab_size == 520
    assert parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]).padded_vocab_size == 512
    with pytest.raises(ConfigError, match="--padded-vocab-size 400 must be at least the tokenizer's 500"):
        parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--padded-vocab-size", "400"])


def test_local_rank_of_the_legacy_launcher(monkeypatch):
    """torch.distributed.launch passes --local-rank N: accepted; contradicting LOCAL_RANK is an error."""
    from paratron.train.distributed import init_distributed
    cfg = parse_args(BASE + ["--local-rank", "0", "--device", "cpu"])
    assert cfg.parallel.local_rank == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert init_distributed(cfg).type == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="--local-rank 0 contradicts LOCAL_RANK=1"):
        init_distributed(cfg)


@pytest.mark.parametrize("extra,layout", [
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], "Ettt|tttL"),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--virtual-pipeline-model-parallel-size", "2"], "Et|tt|tt|tL"),
    (["--account-for-embedding-in-pipeline-split"], None),  # 6 + 1 layers do not split over 2 stages
    (["--account-for-loss-in-pipeline-split", "--virtual-pipeline-model-parallel-size", "2"], None),
])
def test_accounted_pipeline_splits_become_layouts(extra, layout):
    """Megatron's --account-for-embedding/loss-in-pipeline-split: 6 layers on PP 2 (x V) as the layout
    where the embedding / loss take one layer's place."""
    args = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--pipeline-model-parallel-size", "2"]
    if layout is None:
        with pytest.raises(ConfigError, match="must be divisible by the"):
            parse_args(args + extra, world_size=2)
        return
    assert parse_args(args + extra, world_size=2).parallel.pipeline_model_parallel_layout == layout


def test_performance_doc_switch_table_is_current():
    """docs/performance.md's kernel-switch table is generated from the kernels section (make docs)."""
    from pathlib import Path
    from paratron.config.help import field_help
    from paratron.kernels.switches import choices_markdown, write_switches_table
    doc = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
    text = doc.read_text()
    assert text == write_switches_table(text, choices_markdown(field_help)), \
        "regenerate with: python tools/gen_config_docs.py"
    assert "--kernel-cublaslt" in text.split("<!-- switches:begin -->")[1]
