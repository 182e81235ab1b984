"""``paratron convert --from megatron``: Megatron-LM checkpoints (torch_dist and the legacy torch format, TP / PP /
virtual PP / EP) read into paratron's model. Here the Megatron files are laid out by hand from a paratron model's
weights, as Megatron's save writes them (global stacked tensors; per-rank slices); the checkpoints Megatron Core
itself wrote are tests/unit/test_megatron_fixtures.py's."""
from __future__ import annotations

import argparse
import enum
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratron.checkpoint import convert as C
from paratron.checkpoint import megatron as M
from paratron.checkpoint import sharded
from paratron.config import ModelConfig
from paratron.model.gpt import GPTModel

DENSE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
             num_query_groups=2, seq_length=32, max_position_embeddings=64, position_embedding_type="rope",
             normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(DENSE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
ROWS = 128


def _model(kw: dict) -> dict:
    torch.manual_seed(0)
    m = GPTModel(ModelConfig(**kw).resolved(), ROWS)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return {k: v.clone() for k, v in m.state_dict().items()}


class _Backend(enum.Enum):  # stands for a Megatron enum the args hold, pickled under a module this process lacks
    auto = 5


def _args(kw: dict, **extra) -> argparse.Namespace:
    """Megatron's saved args: its flags under their dests (--disable-bias-linear is add_bias_linear=False)."""
    a = {k: v for k, v in kw.items() if k != "disable_bias_linear"}
    a.update(add_bias_linear=not kw.get("disable_bias_linear", False), padded_vocab_size=ROWS, vocab_size=None,
             params_dtype=torch.float32, attention_backend=_Backend.auto, **extra)
    return argparse.Namespace(**a)


def _save_pickle(path, obj):
    """torch.save with _Backend named as an enum of a Megatron module that is not installed here (megatron.training
    is not in megatron-core's wheel)."""
    mod = types.ModuleType("megatron.training.absent_enums")
    _Backend.__module__, _Backend.__qualname__ = mod.__name__, "AttnBackend"
    mod.AttnBackend = _Backend
    sys.modules[mod.__name__] = mod
    try:
        torch.save(obj, path)
    finally:
        del sys.modules[mod.__name__]
        _Backend.__module__, _Backend.__qualname__ = __name__, "_Backend"


def _te_names(state: dict) -> dict:
    """The names under Megatron's Transformer Engine spec: norms fused into the next linear."""
    out = {}
    for k, v in state.items():
        k = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        out[k.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")] = v
    return out


def _write_dist(root, state: dict, args, te: bool = False, iteration: int = 7) -> None:
    """torch_dist: layers stacked along a first dimension, local experts under experts.experts."""
    layers = args.num_layers
    out, stacked = {}, {}
    for k, v in (_te_names(state) if te else state).items():
        if ".layers." not in k:
            out[k] = v
            continue
        pre, rest = k.split(".layers.", 1)
        i, rest = rest.split(".", 1)
        stacked.setdefault(f"{pre}.layers.{rest.replace('mlp.experts.', 'mlp.experts.experts.')}", {})[int(i)] = v
    for k, by_layer in stacked.items():
        out[k] = torch.stack([by_layer[i] for i in range(layers)])
    out["decoder.layers.self_attention.linear_qkv._extra_state"] = b"te fp8 metadata"  # (an object, skipped)
    d = root / f"iter_{iteration:07d}"
    dcp.save(out, checkpoint_id=str(d), no_dist=True)
    _save_pickle(d / "common.pt", {"args": args, "iteration": iteration, "checkpoint_version": 3.0})
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / M.TRACKER).write_text(str(iteration))


def _tp_slice(k: str, v: torch.Tensor, tp: int, r: int, swiglu: bool) -> torch.Tensor:
    if "linear_fc1" in k and v.dim() >= 1 and swiglu:  # [gate; up]: each rank its part of each half
        g, u = v.chunk(2, dim=0)
        return torch.cat([g.chunk(tp, dim=0)[r], u.chunk(tp, dim=0)[r]])
    if k.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return v.chunk(tp, dim=0)[r]
    if k.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return v.chunk(tp, dim=1)[r]
    return v


def _write_legacy(root, state: dict, args, tp: int, pp: int, vpp: int = 1, ep: int = 1, te_grouped: bool = False):
    """One model_optim_rng.pt per (tp, pp, ep) rank: TP slices, layers numbered from 0 in each chunk (chunk v of
    stage p holds virtual stage v * pp + p), experts numbered from 0 on each expert rank."""
    per_chunk = args.num_layers // (pp * vpp)
    experts = getattr(args, "num_experts", None) or 0
    for p in range(pp):
        for e in range(ep):
            for r in range(tp):
                chunks = {}
                for v in range(vpp):
                    first = (v * pp + p) * per_chunk
                    sd = {}
                    for k, t in state.items():
                        if ".layers." not in k:
                            keep = (k.startswith("embedding") and p == 0 and v == 0) or (
                                not k.startswith("embedding") and p == pp - 1 and v == vpp - 1)
                            if keep:
                                sd[k] = _tp_slice(k, t, tp, r, args.swiglu)
                            continue
                        pre, rest = k.split(".layers.", 1)
                        i, rest = rest.split(".", 1)
                        if not first <= int(i) < first + per_chunk:
                            continue
                        name = f"{pre}.layers.{int(i) - first}.{rest}"
                        if rest.startswith("mlp.experts."):
                            local = experts // ep
                            for j in range(local):
                                one = _tp_slice(rest, t[e * local + j], tp, r, args.swiglu)
                                role = rest.split(".")[2]  # linear_fc1 / linear_fc2
                                sub = (f"mlp.experts.{role}.weight{j}" if te_grouped
                                       else f"mlp.experts.local_experts.{j}.{role}.weight")
                                sd[f"{pre}.layers.{int(i) - first}.{sub}"] = one
                        else:
                            sd[name] = _tp_slice(k, t, tp, r, args.swiglu)
                        sd[name.rsplit(".", 1)[0] + "._extra_state"] = None
                    chunks["model" if vpp == 1 else f"model{v}"] = sd
                name = f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                d = root / "iter_0000020" / name
                d.mkdir(parents=True)
                _save_pickle(d / M.LEGACY_FILE, {"args": args, "iteration": 20, "checkpoint_version": 3.0, **chunks})
    (root / M.TRACKER).write_text("20")


def _converted(src, dst, kw) -> dict:
    flags = C.from_megatron(src, dst, log=lambda *a: None)
    assert "--swiglu" in flags and "--num-query-groups" in flags
    state = sharded.load_full(sharded.iter_dir(dst, 0))
    got = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    model = GPTModel(ModelConfig(**kw).resolved(), ROWS)
    model.load_state_dict(got, strict=True)  # every parameter, nothing else
    return got


@pytest.mark.parametrize("te", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("kw", [DENSE, MOE], ids=["dense", "moe"])
def test_torch_dist_checkpoint_converts_to_the_same_weights(tmp_path, kw, te):
    state = _model(kw)
    _write_dist(tmp_path / "mlm", state, _args(kw), te=te)
    got = _converted(tmp_path / "mlm", tmp_path / "out", kw)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.parametrize("tp,pp,vpp,ep,kw", [(2, 1, 1, 1, DENSE), (2, 2, 1, 1, DENSE), (1, 2, 2, 1, DENSE),
                                             (2, 1, 1, 2, MOE), (1, 2, 1, 2, MOE)])
def test_legacy_checkpoint_of_any_layout_converts_to_the_same_weights(tmp_path, tp, pp, vpp, ep, kw):
    state = _model(kw)
    args = _args(kw, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    _write_legacy(tmp_path / "mlm", state, args, tp, pp, vpp, ep, te_grouped=(pp == 2))
    got = _converted(tmp_path / "mlm", tmp_path / "out", kw)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_release_directory(tmp_path):
    state = _model(DENSE)
    _write_dist(tmp_path / "mlm", state, _args(DENSE))
    (tmp_path / "mlm" / "iter_0000007").rename(tmp_path / "mlm" / "release")
    (tmp_path / "mlm" / M.TRACKER).write_text("release\n")
    got = _converted(tmp_path / "mlm", tmp_path / "out", DENSE)
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_megatron_args_become_paratron_model_flags():
    m = M.model_config(vars(_args(DENSE)))
    assert (m.disable_bias_linear, m.swiglu, m.num_query_groups, m.normalization) == (True, True, 2, "RMSNorm")
    a = vars(_args(dict(DENSE, disable_bias_linear=False)))
    assert M.model_config(a).disable_bias_linear is False
    # Megatron Core's generated flags keep their config field's name: --norm-epsilon is layernorm_epsilon
    a = vars(_args({k: v for k, v in DENSE.items() if k != "norm_epsilon"}, layernorm_epsilon=1e-6))
    assert M.model_config(a).norm_epsilon == 1e-6
    # a dense run's args hold Megatron's MoE defaults, and a GPT's its encoder sizes: not paratron flags then
    a = vars(_args(DENSE, moe_layer_freq=1, moe_token_dispatcher_type="allgather", encoder_num_layers=4))
    assert M.model_config(a).num_layers == 4
    with pytest.raises(Exception, match="trained with --apply-residual-connection-post-layernorm, which paratron"):
        M.model_config(vars(_args(DENSE, apply_residual_connection_post_layernorm=True)))


def test_wrong_inputs_are_one_line_errors(tmp_path, capsys):
    from paratron.cli import main as cli_main
    empty = tmp_path / "empty"
    empty.mkdir()
    odd = tmp_path / "odd"
    (odd / "iter_0000003").mkdir(parents=True)
    (odd / M.TRACKER).write_text("3")
    state = _model(DENSE)
    _write_dist(tmp_path / "mlm", state, _args(DENSE))
    taken = tmp_path / "taken"
    C.from_megatron(tmp_path / "mlm", taken, log=lambda *a: None)
    etp = tmp_path / "etp"  # experts split over another tensor-parallel size than the dense layers
    _write_legacy(etp, _model(MOE), _args(MOE, tensor_model_parallel_size=2, expert_tensor_parallel_size=1), 2, 1)
    mla = tmp_path / "mla"
    _write_legacy(mla, state, _args(DENSE, tensor_model_parallel_size=2, multi_latent_attention=True), 2, 1)
    cases = {
        "has no latest_checkpointed_iteration.txt": ["--input", empty, "--save", tmp_path / "o1"],
        "is not a Megatron-LM checkpoint": ["--input", odd, "--save", tmp_path / "o2"],
        "does not exist": ["--input", tmp_path / "mlm", "--save", tmp_path / "o3", "--iteration", "9"],
        "already holds a paratron checkpoint": ["--input", tmp_path / "mlm", "--save", taken],
        "--expert-tensor-parallel-size unlike --tensor-model-parallel-size": ["--input", etp, "--save",
                                                                              tmp_path / "o5"],
        "multi-latent attention saved with tensor parallelism": ["--input", mla, "--save", tmp_path / "o6"],
        "--tensor-model-parallel-size does not apply to --from megatron": [
            "--input", tmp_path / "mlm", "--save", tmp_path / "o4", "--tensor-model-parallel-size", "2"],
    }
    for expect, argv in cases.items():
        capsys.readouterr()
        assert cli_main(["convert", "--from", "megatron", *map(str, argv)]) == 2, expect
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err, (expect, err)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))


def test_pretrain_with_load_of_a_megatron_checkpoint_says_to_convert_it(tmp_path):
    """--load pointing at Megatron's own checkpoint stops with the command that converts it (it would otherwise
    be taken for a directory without a checkpoint and train from scratch)."""
    _write_dist(tmp_path / "mlm", _model(DENSE), _args(DENSE))
    with pytest.raises(Exception, match=r"Megatron-LM checkpoint \(torch_dist format, iter_0000007\).*"
                                        r"paratron convert --from megatron --input"):
        sharded.find_checkpoint(tmp_path / "mlm")
