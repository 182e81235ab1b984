"""Context parallelism on CPU/gloo.

- Attention: ring (p2p), Ulysses (a2a), all-gather and (CP 4 as 2 x 2) hierarchical a2a+p2p attention at CP 2 and CP 4, forward and backward, equal
  full attention on one rank for causal and packed-document masks with GQA (cp_attention_cases.py).
- Training (and a forward-only evaluation): CP 2, CP 4, CP2 x TP2 with sequence parallelism, CP2 x PP2, CP2 x DP2 with the
  distributed optimizer, a2a, allgather, a2a+p2p, per-layer types (Megatron's --cp-comm-type list), packed
  documents, sliding windows with attention sinks
  (ring and a2a), recomputation, on a Llama-style model (RoPE, GQA):
  losses and parameters after 3 steps equal the one-rank run within 1e-5 relative.
- Checkpoints: what CP 2 saves, a CP 1 run loads (same parameters).

Each world size spawns its ranks once (module fixtures) and runs every case there."""
import pytest
import torch

from paratron.parallel.stages import global_named_parameters
from paratron.parallel.tensor import gather_full
from tests.dist import run_ranks
from tests.parallel.common import VOCAB, global_batches, micro_batches, tiny_config
from tests.parallel.cp_attention_cases import KINDS, MASKS, attention_cases

STEPS = 3
EOD = VOCAB - 1
DOCS = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
WINDOW_SINKS = dict(window_size="5,0", window_attn_skip_freq=2, softmax_type="learnable")  # gpt-oss's pattern
CASES = {  # name -> (world, settings); every case is the Llama-style tiny model (RoPE, 8 heads, 4 groups)
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2_a2a_docs": (2, dict(context_parallel_size=2, cp_comm_type="a2a", **DOCS)),
    "cp2_allgather": (2, dict(context_parallel_size=2, cp_comm_type="allgather")),
    "cp4_allgather_docs": (4, dict(context_parallel_size=4, cp_comm_type="allgather", **DOCS)),
    "cp4_a2a_p2p_docs": (4, dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
                                 hierarchical_context_parallel_sizes=[2, 2], **DOCS)),
    "cp2_window_sinks": (2, dict(context_parallel_size=2, **WINDOW_SINKS)),
    "cp2_per_layer_a2a_allgather_docs": (2, dict(context_parallel_size=2, cp_comm_type="a2a allgather", **DOCS)),
    "cp4_per_layer_p2p_a2a_p2p": (4, dict(context_parallel_size=4, cp_comm_type="a2a+p2p p2p",
                                          hierarchical_context_parallel_sizes=[2, 2])),
    "cp4_a2a_window_sinks_docs": (4, dict(context_parallel_size=4, cp_comm_type="a2a", **WINDOW_SINKS, **DOCS)),
    "cp2_docs_selective": (2, dict(context_parallel_size=2, recompute_granularity="selective", **DOCS)),
    "cp2_per_token_loss": (2, dict(context_parallel_size=2, calculate_per_token_loss=True)),
    "cp4": (4, dict(context_parallel_size=4)),
    "cp2_tp2_sp_full_recompute": (4, dict(context_parallel_size=2, tensor_model_parallel_size=2,
                                          sequence_parallel=True, recompute_granularity="full",
                                          recompute_method="uniform", recompute_num_layers=1)),
    "cp2_pp2": (4, dict(context_parallel_size=2, pipeline_model_parallel_size=2)),
    "cp2_dp2_distopt_docs": (4, dict(context_parallel_size=2, use_distributed_optimizer=True, **DOCS)),
}


def config(settings: dict, **extra):
    return tiny_config("llama", **settings, **extra, eval_iters=1)


def packed_batches(cfg, steps: int) -> list[dict]:
    """global_batches with EOD tokens inside: document ids, position ids restarting after each EOD,
    no loss on EOD (what GPTDataset gives with the three reset flags)."""
    out = []
    for x in global_batches(cfg, steps):
        tokens = x["tokens"].clone()
        tokens[torch.randperm(tokens.numel(), generator=torch.Generator().manual_seed(int(tokens[0])))[:4]] = EOD
        eod = (tokens == EOD).long()
        docs = torch.cumsum(eod, 0) - eod
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (torch.nonzero(eod)[:, 0] + 1)])
        pos = torch.arange(tokens.numel()) - starts[docs]
        out.append(dict(x, tokens=tokens, loss_mask=x["loss_mask"] * (1 - eod), position_ids=pos, document_ids=docs))
    return out


def run_case(settings: dict, save: str | None = None) -> dict:
    from paratron.parallel.context import ContextParallel
    kinds, kind = set(), ContextParallel.kind  # the comm types attention used (per-layer lists: each layer's)
    ContextParallel.kind = lambda self, layer=None: kinds.add(kind(self, layer)) or kind(self, layer)
    try:
        return {**_run_case(settings, save), "kinds": kinds}
    finally:
        ContextParallel.kind = kind


def train_watching_lengths(trainer, steps: int) -> tuple[list, list]:
    """``steps`` training steps: (their losses, the sequence lengths the model's embedding was given: this rank's
    part of each sequence)."""
    seen = []
    for m in trainer.models:
        if m.module.embedding is not None:
            m.module.embedding.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    losses = []
    for _ in range(steps):
        report, _, _ = trainer.train_step()
        losses.append((report[0] / report[1].clamp(min=1)).item())
    return losses, seen


def _run_case(settings: dict, save: str | None = None) -> dict:
    from paratron.train.loop import Trainer, build_dims
    cfg = config(settings, **({"save": save} if save else {}))
    dims = build_dims(cfg)
    make = packed_batches if cfg.data.reset_attention_mask else global_batches
    valid = micro_batches(make(cfg, STEPS + 1)[-cfg.train.global_batch_size:], cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims,
                      data=(micro_batches(make(cfg, STEPS), cfg, dims.dp_rank, dims.dp), valid))
    losses, seen = train_watching_lengths(trainer, STEPS)
    valid_loss = trainer.evaluate()  # forward only
    if save:
        trainer.save()
    params = {n: gather_full(p, dims.tp_group).clone() for n, p in global_named_parameters(trainer.models).items()}
    trainer.close()
    return {"losses": losses, "valid": valid_loss, "params": params, "last_stage": dims.is_last_stage, "seen": set(seen)}


def _ranks(rank, world, names, ckpt):
    out = {name: run_case(CASES[name][1], ckpt if name == "cp2" else None) for name in names}
    if world == 4:  # CP 2 (two rings) and CP 4
        out["attention"] = attention_cases(rank, world)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    out = {"ckpt": ckpt, "attention": {}}
    for world in (2, 4):
        names = [n for n, (w, _) in CASES.items() if w == world]
        per_rank = run_ranks(world, _ranks, names, ckpt, tmp_dir=tmp_path_factory.mktemp(f"w{world}"))
        out["attention"].update(per_rank[0].get("attention", {}))
        out.update({name: [r[name] for r in per_rank] for name in names})
    return out


REFERENCES = {"plain": {}, "docs": DOCS, "per_token": dict(calculate_per_token_loss=True),
              "window_sinks": WINDOW_SINKS, "window_sinks_docs": dict(WINDOW_SINKS, **DOCS)}


def reference_of(settings: dict) -> str:
    if settings.get("window_size"):
        return "window_sinks_docs" if settings.get("reset_attention_mask") else "window_sinks"
    return "docs" if settings.get("reset_attention_mask") else "per_token" if settings.get(
        "calculate_per_token_loss") else "plain"


@pytest.fixture(scope="module")
def reference():
    return {name: run_case(settings) for name, settings in REFERENCES.items()}


def test_cp_attention_equals_full_attention(results):
    errors = results["attention"]
    assert set(errors) == {(cp, kind, mask) for cp in (2, 4) for kind in KINDS
                           for mask in MASKS if cp == 4 or kind != "a2a+p2p"}
    for case, err in errors.items():
        assert err < 1e-5, f"{case}: relative difference {err:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_training_equals_single_rank(name, results, reference):
    ref = reference[reference_of(CASES[name][1])]
    ranks = results[name]
    cp = CASES[name][1]["context_parallel_size"]
    assert set().union(*(r["seen"] for r in ranks)) == {32 // cp}  # the model saw only its shard
    assert set().union(*(r["kinds"] for r in ranks)) == set(CASES[name][1].get("cp_comm_type", "p2p").split())
    merged = {}
    for r in ranks:
        if r["last_stage"]:
            for i, (a, b) in enumerate(zip(ref["losses"], r["losses"])):
                assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs one rank {a}"
            assert abs(r["valid"] - ref["valid"]) <= 1e-5 * ref["valid"], (r["valid"], ref["valid"])
        merged.update(r["params"])  # pipeline stages hold different layers
    assert merged.keys() == ref["params"].keys()
    for n, a in ref["params"].items():
        err = ((a - merged[n]).norm() / a.norm()).item()
        assert err <= 1e-5, f"{n}: relative difference {err:.2e}"


def test_cp2_checkpoint_loads_at_cp1(results):
    from paratron.train.loop import Trainer
    cfg = config({}, load=results["ckpt"], no_load_rng=True)
    trainer = Trainer(cfg, device=torch.device("cpu"), data=(iter(()), None))
    loaded = {n: p.detach() for n, p in trainer.model.module.named_parameters()}
    trainer.close()
    saved = results["cp2"][0]["params"]
    assert trainer.iteration == STEPS and loaded.keys() == saved.keys()
    for n, p in loaded.items():
        assert torch.equal(p, saved[n]), n
