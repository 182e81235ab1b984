"""Megatron-LM's hybrid (Mamba) models' names and layouts (paratron/checkpoint/megatron_hybrid.py), checked by hand:
the torch_dist blocks, the legacy format's TP merge and the pieces that read blocks into a run's tensors."""
from pathlib import Path

import pytest
import torch

from paratron.checkpoint import megatron_hybrid as hybrid
from paratron.checkpoint.pieces import Piece
from paratron.config import parse_args
from paratron.model.gpt import GPTModel

PATTERN = "M*M-"
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--hybrid-layer-pattern", PATTERN,
         "--vocab-size", "128", "--seq-length", "32", "--max-position-embeddings", "32", "--mamba-num-groups", "2",
         "--mamba-head-dim", "16", "--mamba-state-dim", "8", "--position-embedding-type", "none", "--normalization",
         "RMSNorm", "--disable-bias-linear", "--squared-relu", "--tokenizer-type", "NullTokenizer", "--train-iters",
         "1", "--lr", "1e-3", "--mock-data"]
# d_inner = 2 x 64 = 128 (8 heads of 16), B and C: 2 groups x state 8 = 16 rows each
BLOCKS = {"in_proj": (128, 128, 16, 16, 8), "conv": (128, 16, 16)}


def _state() -> tuple[object, dict]:
    cfg = parse_args(FLAGS).model
    torch.manual_seed(0)
    model = GPTModel(cfg, 128)
    return cfg, {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # (distinct values everywhere)


def test_blocks_follow_the_args():
    cfg, _ = _state()
    assert hybrid.mixer_blocks(hybrid.model_args(cfg)) == BLOCKS
    assert hybrid.mixer_blocks({"hidden_size": 64}) == {}  # (a GPT model's args)


def test_names_round_trip_through_megatrons():
    cfg, state = _state()
    done, rest = hybrid.to_megatron_names(state, PATTERN, BLOCKS)
    z, dt = done["decoder.layers.0.mixer.in_proj.weight.z"], done["decoder.layers.2.mixer.in_proj.weight.dt"]
    assert z.shape == (128, 64) and dt.shape == (8, 64)
    assert torch.equal(dt, state["decoder.layers.2.self_attention.in_proj.weight"][-8:])
    conv_bias = state["decoder.layers.0.self_attention.conv1d_bias"]
    assert torch.equal(done["decoder.layers.0.mixer.conv1d.bias.C"], conv_bias[-16:])
    assert torch.equal(done["decoder.layers.0.mixer.in_proj.layer_norm_weight"],
                       state["decoder.layers.0.input_layernorm.weight"])
    assert torch.equal(done["decoder.final_norm.weight"], state["decoder.final_layernorm.weight"])
    assert {k.split(".")[2] for k in rest if k.startswith("decoder.layers.")} == {"1", "3"}  # attention, MLP: GPT's
    back = {hybrid.to_paratron_name(k): v for k, v in hybrid.join_parts(done).items()}
    assert set(back) == set(state) - set(rest)
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_local_spec_names_read_too():
    """Megatron's local spec keeps a Mamba layer's norm as its own module (``norm.weight``)."""
    assert hybrid.to_paratron_name("decoder.layers.2.norm.weight") == "decoder.layers.2.input_layernorm.weight"
    assert hybrid.to_paratron_name("decoder.layers.2.mixer.norm.weight") == \
        "decoder.layers.2.self_attention.norm.weight"
    assert hybrid.to_paratron_name("decoder.layers.0.mixer.conv1d.weight") == \
        "decoder.layers.0.self_attention.conv1d_weight"


def test_a_missing_block_is_named():
    _, state = _state()
    done, _ = hybrid.to_megatron_names(state, PATTERN, BLOCKS)
    del done["decoder.layers.0.mixer.in_proj.weight.B"]
    try:
        hybrid.join_parts(done)
    except Exception as e:  # noqa: BLE001
        assert "decoder.layers.0.mixer.in_proj.weight.B" in str(e)
    else:
        raise AssertionError("a checkpoint without one of in_proj's blocks was read")


def _rank_slice(whole: torch.Tensor, sizes: tuple, rank: int, tp: int) -> torch.Tensor:
    """What a legacy rank file holds: the rank's share of each block, one after the other."""
    return torch.cat([b.chunk(tp)[rank] for b in whole.split(list(sizes))])


def test_legacy_rank_files_merge_block_by_block():
    _, state = _state()
    pre = "decoder.layers.0.mixer."
    whole = {"in_proj.weight": state["decoder.layers.0.self_attention.in_proj.weight"],
             "conv1d.weight": state["decoder.layers.0.self_attention.conv1d_weight"]}
    for name, t in whole.items():
        sizes = BLOCKS["in_proj" if name.startswith("in_proj") else "conv"]
        parts = [_rank_slice(t, sizes, r, 2) for r in range(2)]
        assert not torch.equal(torch.cat(parts), t)  # (the naive concatenation would be wrong)
        assert torch.equal(hybrid.merge_mixer(pre + name, parts, BLOCKS), t)
    d = state["decoder.layers.0.self_attention.D"]
    assert torch.equal(hybrid.merge_mixer(pre + "D", list(d.chunk(2)), BLOCKS), d)
    out = state["decoder.layers.0.self_attention.out_proj.weight"]
    assert torch.equal(hybrid.merge_mixer(pre + "out_proj.weight", list(out.chunk(2, dim=1)), BLOCKS), out)
    assert hybrid.merge_mixer("decoder.layers.1.self_attention.linear_qkv.weight", [out], BLOCKS) is None


def test_block_pieces_cover_a_whole_tensor_and_write_through():
    name = "decoder.layers.0.mixer.in_proj.weight"
    shapes = {f"{name}.{b}": (n, 64) for b, n in zip(hybrid.IN_PROJ, BLOCKS["in_proj"])}
    target = torch.zeros(296, 64)
    pieces = hybrid.block_pieces(Piece("x", (296, 64), (0, 0), target), name, shapes)
    assert [(p.key.rsplit(".", 1)[1], p.shape[0], p.offsets[0], p.tensor.shape[0]) for p in pieces] == \
        [("z", 128, 0, 128), ("x", 128, 0, 128), ("B", 16, 0, 16), ("C", 16, 0, 16), ("dt", 8, 0, 8)]
    pieces[4].tensor.fill_(1.0)
    assert target[-8:].eq(1).all() and target[:-8].eq(0).all()
    # a TP 2 rank's piece of the B block (rows 256 + 8 .. 256 + 16): one piece of the B tensor
    local = torch.zeros(8, 64)
    (piece,) = hybrid.block_pieces(Piece("x", (296, 64), (264, 0), local), name, shapes)
    assert (piece.key, piece.shape, piece.offsets) == (f"{name}.B", (16, 64), (8, 0))
    other = "decoder.layers.1.self_attention.linear_proj.weight"
    assert hybrid.block_pieces(Piece("x", (64, 64), (0, 0), local), other, shapes) is None


# ---- checkpoints Megatron-LM itself wrote (tests/data/megatron_ckpt/*_mamba_tp2, README there) -----------------

DATA = Path(__file__).resolve().parent.parent / "data" / "megatron_ckpt"


def _logits(cfg, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = GPTModel(cfg.model, cfg.padded_vocab_size)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(tokens).float()


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
def test_converted_megatron_hybrid_gives_megatrons_logits(tmp_path, fmt, capsys):
    from paratron.checkpoint import convert as C
    ref = torch.load(DATA / "reference_mamba.pt", weights_only=True)
    flags = C.from_megatron(DATA / f"{fmt}_mamba_tp2", tmp_path / "out", log=lambda *a: None)
    assert flags[flags.index("--hybrid-layer-pattern") + 1] == "M*M-"
    assert "  pretrain_mamba.py --hybrid-layer-pattern" in capsys.readouterr().out  # (the command it prints)
    cfg, _, _, state = C.read_checkpoint(tmp_path / "out", log=lambda *a: None)
    assert (cfg.model.mamba_num_groups, cfg.model.mamba_state_dim, cfg.model.squared_relu) == (2, 16, True)
    logits = _logits(cfg, state, ref["tokens"])
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max() < 1e-4 * ref["logits"].abs().max()  # fp32 (a wrong block: ~1)


def test_finetune_loads_megatrons_hybrid_torch_dist_directly(tmp_path):
    """--load MEGATRON_DIR --finetune reads the torch_dist blocks into the run's tensors (TP 1 here; TP 2 in
    tests/parallel/test_megatron_load.py): the same weights as the converted checkpoint."""
    from paratron.checkpoint import convert as C
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args
    from tests.unit.test_megatron_fixtures import _run_flags
    flags = C.from_megatron(DATA / "dist_mamba_tp2", tmp_path / "conv", log=lambda *a: None)
    weights = []
    direct = ["--load", str(DATA / "dist_mamba_tp2"), "--finetune"]
    for given, extra in ((flags, direct), ([], direct + ["--use-checkpoint-args"]),
                         (flags, ["--load", str(tmp_path / "conv"), "--finetune"])):
        t = Trainer(parse_args(_run_flags(given, *extra)))
        weights.append({k: v.clone() for k, v in t.models[0].state_dict().items()})
        t.close()
    for other in weights[1:]:  # (--use-checkpoint-args: the model flags from Megatron's saved args)
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])


@pytest.mark.parametrize("case,pattern", [("dist_mamba_tp2", "M*M-"), ("dist_hybrid_moe_ep2", "ME*E")])
def test_export_equals_megatrons_own_hybrid_checkpoint(tmp_path, case, pattern):
    """Megatron -> paratron -> Megatron: the same tensor and object names, shapes and values as the checkpoint Megatron
    wrote (Megatron-LM itself loads such an export strictly at TP 1 and 2 and computes the same logits: the validation
    on the branch exp/megatron-fixtures)."""
    from torch.distributed.checkpoint import FileSystemReader
    from paratron.checkpoint import convert as C, sharded
    from paratron.checkpoint.megatron import _torch_load
    from paratron.checkpoint.to_megatron import export
    mlm = next((DATA / case).glob("iter_*"))
    C.from_megatron(DATA / case, tmp_path / "conv", log=lambda *a: None)
    out = export(tmp_path / "conv", tmp_path / "mlm", log=lambda *a: None)
    ours, theirs = (FileSystemReader(str(d)).read_metadata().state_dict_metadata for d in (out, mlm))
    assert set(ours) == set(theirs)
    shapes = sharded.tensor_shapes(mlm)
    assert sharded.tensor_shapes(out).keys() == shapes.keys()
    a, b = sharded.load_full(out, list(shapes)), sharded.load_full(mlm, list(shapes))
    assert all(torch.equal(a[k], b[k]) for k in shapes), [k for k in shapes if not torch.equal(a[k], b[k])]
    args = _torch_load(out / "common.pt")["args"]
    assert (args.hybrid_override_pattern, args.num_layers, args.mamba_num_groups) == (pattern, 4, 2)


@pytest.mark.parametrize("case", ["dist_hybrid_moe_ep2", "legacy_hybrid_moe_tp2"])
def test_converted_megatron_hybrid_moe_gives_megatrons_logits(tmp_path, case):
    """Nemotron-3's layout in Megatron's files: Mamba-2, MoE (sigmoid router with a non-zero expert bias, scaling 2.5,
    squared-ReLU experts, a shared expert), attention, MoE; saved at EP 2 (torch_dist) and TP 2 (legacy)."""
    from paratron.checkpoint import convert as C
    ref = torch.load(DATA / "reference_hybrid_moe.pt", weights_only=True)
    C.from_megatron(DATA / case, tmp_path / "out", log=lambda *a: None)
    cfg, _, _, state = C.read_checkpoint(tmp_path / "out", log=lambda *a: None)
    m = cfg.model
    assert (m.hybrid_layer_pattern, m.num_experts, m.moe_router_score_function, m.moe_router_enable_expert_bias,
            m.moe_router_topk_scaling_factor) == ("ME*E", 4, "sigmoid", True, 2.5)
    assert state["decoder.layers.1.mlp.router.expert_bias"].abs().max() > 0
    logits = _logits(cfg, state, ref["tokens"])
    assert (logits - ref["logits"]).abs().max() < 1e-4 * ref["logits"].abs().max()


def test_a_pure_mamba_runs_args_are_marked_by_its_mixer_tensors():
    """Megatron's pretrain_mamba.py with neither a pattern nor ratios (every layer Mamba-2) saves args that look like
    a GPT model's: the mixer tensors mark them, and the model config is the all-Mamba stack."""
    from paratron.checkpoint.megatron import model_config
    args = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "mamba_head_dim": 16,
            "mamba_num_groups": 2, "mamba_state_dim": 8, "normalization": "RMSNorm", "add_bias_linear": False,
            "position_embedding_type": "none", "hybrid_override_pattern": None, "is_hybrid_model": False}
    keys = ["embedding.word_embeddings.weight", "decoder.layers.0.mixer.in_proj.weight"]
    assert hybrid.mixer_blocks(args) == {} and hybrid.marked(args, keys[:1]) is args
    marked = hybrid.marked(args, keys)
    assert hybrid.mixer_blocks(marked) == {"in_proj": (128, 128, 16, 16, 8), "conv": (128, 16, 16)}
    assert model_config(marked).hybrid_layer_pattern == "MMM"
