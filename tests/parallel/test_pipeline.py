"""Pipeline parallelism on CPU/gloo equals the one-rank run: per-step losses, parameters after 3 steps
of 8 micro-batches, and the validation loss of a forward-only evaluation.

Each layout runs several cases in one set of spawned ranks (a module fixture), so the ranks start once
per world size; each test then checks one case against the one-rank reference."""
import pytest
import torch

from paratron.config import ConfigError
from paratron.config.pipeline_split import chunk_layers, stage_layer_counts
from paratron.parallel.stages import global_named_parameters
from paratron.parallel.tensor import gather_full
from tests.dist import run_ranks
from tests.parallel.common import global_batches, micro_batches, tiny_config

STEPS = 3
BASE = dict(num_layers=4, micro_batch_size=1, global_batch_size=8)  # 8 micro-batches per step
CASES = {  # name -> (world, style, settings)
    "pp2": (2, "gpt", dict(pipeline_model_parallel_size=2)),
    "pp2_virtual2": (2, "gpt", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "pp2_uneven_llama": (2, "llama", dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)),
    "pp4": (4, "gpt", dict(pipeline_model_parallel_size=4)),
    "tp2_pp2": (4, "gpt", dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2)),
    "tp2_pp2_sp_llama": (4, "llama", dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                          sequence_parallel=True)),
    "pp2_dp2_virtual2": (4, "gpt", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    # micro-batches' forwards and backwards interleaved: each forward pass's offloaded groups their own chain
    "pp2_virtual2_offload": (2, "llama", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                              fine_grained_activation_offloading=True, min_offloaded_tensor_size=0,
                                              offload_modules=["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                               "mlp_norm"])),
}


def config(style: str, **settings):
    return tiny_config(style, **BASE, **settings, eval_iters=1)


def run_case(style: str, settings: dict) -> dict:
    """A few training steps then one evaluation; this rank's losses and full (TP-gathered) parameters."""
    from paratron.train.loop import Trainer, build_dims
    cfg = config(style, **settings)
    dims = build_dims(cfg)
    train = micro_batches(global_batches(cfg, STEPS), cfg, dims.dp_rank, dims.dp)
    valid = micro_batches(global_batches(cfg, 1, seed=11), cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(train, valid))
    losses = []
    for _ in range(STEPS):
        report, _, _ = trainer.train_step()
        losses.append((report[0] / report[1].clamp(min=1)).item())
    valid_loss = trainer.evaluate()
    params = {n: gather_full(p, dims.tp_group).clone() for n, p in global_named_parameters(trainer.models).items()}
    offloaded = sum(m.module.decoder.offloader.offloaded_bytes for m in trainer.models
                    if hasattr(m.module.decoder, "offloader"))
    trainer.close()
    return {"losses": losses, "valid": valid_loss, "params": params, "last_stage": dims.is_last_stage,
            "replica": dims.tp_rank == 0 and dims.dp_rank == 0, "chunks": len(trainer.models), "offloaded": offloaded}


def _ranks(rank, world, names):
    return {name: run_case(CASES[name][1], CASES[name][2]) for name in names}


@pytest.fixture(scope="module")
def reference():
    return {style: run_case(style, {}) for style in ("gpt", "llama")}


def spawn_cases(cases: dict, ranks_fn, tmp_path_factory) -> dict:
    """{case: [what each rank returned]}: one set of spawned ranks per world size of ``cases``."""
    out = {}
    for world in sorted({w for w, _, _ in cases.values()}):
        names = [n for n, (w, _, _) in cases.items() if w == world]
        per_rank = run_ranks(world, ranks_fn, names, tmp_dir=tmp_path_factory.mktemp(f"w{world}"))
        for name in names:
            out[name] = [r[name] for r in per_rank]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_cases(CASES, _ranks, tmp_path_factory)


def close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(a)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_equals_single_rank(name, results, reference):
    style = CASES[name][1]
    ref = reference[style]
    ranks = results[name]
    last = [r for r in ranks if r["last_stage"]]
    assert last
    for r in last:
        for i, (a, b) in enumerate(zip(ref["losses"], r["losses"])):
            assert close(a, b), f"step {i}: loss {b} vs one rank {a}"
        assert close(ref["valid"], r["valid"]), f"validation loss {r['valid']} vs one rank {ref['valid']}"
    merged, copies = {}, []
    for r in ranks:
        if not r["replica"]:
            continue
        for n, p in r["params"].items():
            if n == "output_layer.weight" and n not in ref["params"]:
                copies.append(p)  # the last stage's copy of the tied embedding
                continue
            assert n not in merged, f"{n} on two pipeline stages"
            merged[n] = p
    assert merged.keys() == ref["params"].keys()
    for n, a in ref["params"].items():
        err = ((a - merged[n]).norm() / a.norm().clamp(min=1e-12)).item()
        assert err <= 1e-5, f"{n}: relative difference {err:.2e}"
    if style == "gpt":  # tied: the last stage's copy stayed equal to the first stage's embedding
        assert len(copies) == 1 and torch.equal(copies[0], merged["embedding.word_embeddings.weight"])


def test_virtual_stages_build_two_chunks(results):
    assert all(r["chunks"] == 2 for r in results["pp2_virtual2"])
    assert all(r["chunks"] == 1 for r in results["pp2"])
    assert all(r["offloaded"] > 0 for r in results["pp2_virtual2_offload"])  # (each stage's chunks offloaded)
    assert all(r["offloaded"] == 0 for r in results["pp2"])


# ---- layout checks: one-line ConfigErrors before anything runs -----------------------------------
def test_stage_split():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert stage_layer_counts(7, 3, last=1) == [3, 3, 1]
    assert chunk_layers(8, 2, 2) == {(0, 0): (0, 2), (0, 1): (2, 2), (1, 0): (4, 2), (1, 1): (6, 2)}
    assert chunk_layers(6, 2, 1, first=2) == {(0, 0): (0, 2), (0, 1): (2, 4)}


@pytest.mark.parametrize("settings,match", [
    (dict(num_layers=6, pipeline_model_parallel_size=4), "not divisible by --pipeline-model-parallel-size 4"),
    (dict(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3),
     "do not split evenly over the other 3"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=5), "add up to more"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
     "divisible by 4"),
    (dict(num_layers=4, virtual_pipeline_model_parallel_size=2), "needs --pipeline-model-parallel-size > 1"),
    (dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3), "must divide"),
    (dict(num_layers=4, decoder_last_pipeline_num_layers=1), "need --pipeline-model-parallel-size > 1"),
])
def test_layout_errors(settings, match):
    with pytest.raises(ConfigError, match=match) as e:
        tiny_config("gpt", **settings)
    assert "\n" not in str(e.value)


def test_layers_per_virtual_stage_sets_the_virtual_size():
    cfg = tiny_config("gpt", world_size=2, num_layers=8, pipeline_model_parallel_size=2,
                      num_layers_per_virtual_pipeline_stage=2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2


def _too_few(rank, world):
    from paratron.train.loop import Trainer, build_dims
    cfg = tiny_config("gpt", num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                      micro_batch_size=1, global_batch_size=3)
    try:
        Trainer(cfg, device=torch.device("cpu"), dims=build_dims(cfg), data=(iter([]), None))
    except ConfigError as e:
        return str(e)
    return None


def test_interleaving_needs_micro_batches_multiple_of_stages(tmp_path):
    for msg in run_ranks(2, _too_few, tmp_dir=tmp_path):
        assert msg is not None and "multiple of --pipeline-model-parallel-size 2" in msg and "\n" not in msg
