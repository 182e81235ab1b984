"""Context parallelism for hybrid stacks on CPU/gloo: Mamba-2 and Gated DeltaNet layers hand each CP rank the
whole sequence of its share of the heads (one all-to-all, the load-balancing permutation undone), run the
convolution and the scan there, and bring the output back (paratron/parallel/context.py
``channels_to_sequence``). A tiny ``MG*-`` stack trained 3 steps at CP 2 (with and without packed documents, the
resets taken from the whole sequence's document ids), at CP 2 x TP 2 + SP and at CP 2 x PP 2 (packed documents)
gives the losses and every parameter of one rank within 1e-5 relative; the embedding sees s / CP tokens."""
import pytest
import torch

from paratron.parallel.stages import global_named_parameters
from paratron.parallel.tensor import gather_full
from tests.dist import run_ranks
from tests.parallel.common import global_batches, micro_batches, tiny_config
from tests.parallel.test_context_parallel import DOCS, packed_batches, train_watching_lengths

STEPS = 3
# 8 Mamba-2 heads in 4 groups, 4 DeltaNet key heads serving 8 value heads: divisible by TP 2 x CP 2.
HYBRID = dict(hybrid_layer_pattern="MG*-", normalization="RMSNorm", position_embedding_type="none",
              disable_bias_linear=True, mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=4,
              mamba_chunk_size=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
              linear_num_value_heads=8)
CASES = {  # name -> (world, settings)
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2_docs": (2, dict(context_parallel_size=2, **DOCS)),
    "cp2_tp2_sp_docs": (4, dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                                **DOCS)),
    "cp2_pp2_docs": (4, dict(context_parallel_size=2, pipeline_model_parallel_size=2, hybrid_layer_pattern="MG|*-",
                             **DOCS)),  # the resets on the second stage too
}

def run_case(settings: dict) -> dict:
    """3 training steps of the hybrid stack: the losses, every (TP-gathered) parameter, the embedding's input
    lengths."""
    from paratron.train.loop import Trainer, build_dims
    cfg = tiny_config("gpt", **{**HYBRID, **settings})
    dims = build_dims(cfg)
    make = packed_batches if cfg.data.reset_attention_mask else global_batches
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims,
                      data=(micro_batches(make(cfg, STEPS), cfg, dims.dp_rank, dims.dp), None))
    losses, seen = train_watching_lengths(trainer, STEPS)
    params = {n: gather_full(p, dims.tp_group).clone() for n, p in global_named_parameters(trainer.models).items()}
    trainer.close()
    return {"losses": losses, "params": params, "seen": set(seen), "last_stage": dims.is_last_stage}


def _ranks(rank, world, names):
    return {name: run_case(CASES[name][1]) for name in names}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world in (2, 4):
        names = [n for n, (w, _) in CASES.items() if w == world]
        per_rank = run_ranks(world, _ranks, names, tmp_dir=tmp_path_factory.mktemp(f"w{world}"))
        out.update({name: [r[name] for r in per_rank] for name in names})
    return out


@pytest.fixture(scope="module")
def reference():
    return {"plain": run_case({}), "docs": run_case(DOCS)}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_context_parallel_equals_single_rank(name, results, reference):
    settings = CASES[name][1]
    ref = reference["docs" if settings.get("reset_attention_mask") else "plain"]
    merged = {}
    for r in results[name]:
        assert r["seen"] <= {32 // settings["context_parallel_size"]}  # the model saw only its shard
        if r["last_stage"]:
            for i, (a, b) in enumerate(zip(ref["losses"], r["losses"])):
                assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs one rank {a}"
        merged.update((n, p) for n, p in r["params"].items() if n in ref["params"])  # stages hold different layers
    assert set().union(*(r["seen"] for r in results[name])) == {32 // settings["context_parallel_size"]}
    assert merged.keys() == ref["params"].keys()
    for n, a in ref["params"].items():
        err = ((a - merged[n]).norm() / a.norm()).item()
        assert err <= 1e-5, f"{n}: relative difference {err:.2e}"
