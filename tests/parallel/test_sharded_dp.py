"""Sharded data parallelism (--use-megatron-fsdp --data-parallel-sharding-strategy, ZeRO-0..3) and optimizer
CPU offload on CPU/gloo: losses and parameters after 3 steps equal one rank's, the bytes each rank holds equal
the strategy's shares, and checkpoints resume across strategies, data-parallel sizes, TP and offload.

One launch of 2 ranks and one of 4 run every case in turn (each a few real Trainer steps of a tiny model);
the world-4 launch resumes from checkpoints the world-2 launch saved."""
from __future__ import annotations

import math

import pytest
import torch

from paratron.checkpoint.state import param_keys
from paratron.optim.memory import per_rank_state_bytes, predicted_state_bytes
from paratron.parallel.data import ALIGN
from paratron.parallel.tensor import gather_global
from tests.dist import run_ranks
from tests.parallel.common import global_batches, micro_batches, tiny_config

STEPS = 3
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BUCKET = 4000  # elements: several buckets per buffer
pytestmark = pytest.mark.slow  # (one launch of 2 ranks and one of 4, about 25 cases)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
           moe_router_dtype="fp32")


def fsdp(strategy: str, **kw) -> dict:
    return dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, **kw)


def train(cfg, steps: int = STEPS, save_after: int | None = None, nan_at: int | None = None) -> dict:
    """``steps`` Trainer steps (after any checkpoint it loads); losses, global parameters by checkpoint name,
    the bytes this rank holds and what its buffers predict. ``nan_at``: at that step data-parallel rank 0's
    gradient shard gets a NaN (the run's error message is returned)."""
    from paratron.train.guards import NumericalError
    from paratron.train.loop import Trainer, build_dims
    dims = build_dims(cfg)
    t = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(iter(()), None))
    start = t.consumed_samples
    t.train_iter = micro_batches(global_batches(cfg, steps + t.iteration)[start:], cfg, dims.dp_rank, dims.dp)
    if nan_at is not None:
        inner = t.optimizer._grads

        def grads():
            gs = inner()
            if t.iteration == nan_at and dims.dp_rank == 0:
                gs[0].view(-1)[0] = float("nan")
            return gs
        t.optimizer._grads = grads
    out = {"losses": []}
    try:
        for _ in range(steps):
            report, _, norm = t.train_step()
            t.guard.record(t.iteration, report, norm)  # (as Trainer.train does: the NaN check)
            out["losses"].append((report[0] / report[1]).item())
            if save_after is not None and t.iteration == save_after:
                t.save()
        t.guard.check()
    except NumericalError as e:
        t.close()
        return {"error": str(e)}
    out["bytes"], out["predicted"], out["padding"] = per_rank_state_bytes(t.models, t.optimizer), *_predicted(t)
    out["prefetches"] = sum(m.units.prefetches for m in t.models if m.units is not None)
    params = {}
    for m in t.models:
        with m.gathered():
            for p, key in param_keys([m]).items():
                params[key] = gather_global(p, dims).float().clone()
    out["params"] = params
    t.close()
    return out


def _predicted(t) -> tuple[dict, dict]:
    """The shares predicted from the parameter counts of each gradient buffer, and the padding bound."""
    mixed = t.optimizer.mixed
    pred, pad = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}, {"params": 0, "grads": 0, "optimizer": 0}
    for m in t.models:
        for buf in m.grad_buffers:
            n = sum(p.numel() for p in buf.params)
            shares = predicted_state_bytes(n, buf.n, buf.level, buf.params[0].element_size(),
                                           buf.reduced_grads()[0].element_size(), mixed)
            slack = sum(ALIGN * (buf.n + len(b.params)) for b in buf.buckets)
            for k in pred:
                pred[k] += getattr(shares, k)
            pad["params"] += slack * buf.params[0].element_size()
            pad["grads"] += slack * buf.reduced_grads()[0].element_size()
            pad["optimizer"] += slack * (12 if mixed else 8)
    return pred, pad


def _world2(rank, world, root):
    out = {s: train(tiny_config(**fsdp(s))) for s in STRATEGIES}
    out["zero2_overlap"] = train(tiny_config(**fsdp("optim_grads", overlap_grad_reduce=True, overlap_param_gather=True,
                                                    ddp_bucket_size=BUCKET)))
    out["zero3_overlap"] = train(tiny_config(**fsdp("optim_grads_params", overlap_grad_reduce=True,
                                                    overlap_param_gather=True, ddp_bucket_size=BUCKET)))
    out["zero3_recompute"] = train(tiny_config(**fsdp("optim_grads_params", recompute_granularity="full",
                                                      recompute_method="uniform", recompute_num_layers=1)))
    out["zero1_per_token"] = train(tiny_config(use_distributed_optimizer=True, calculate_per_token_loss=True))
    out["zero3_per_token"] = train(tiny_config(**fsdp("optim_grads_params", calculate_per_token_loss=True)))
    out["zero1_bf16"] = train(tiny_config(use_distributed_optimizer=True, bf16=True))
    out["zero3_bf16"] = train(tiny_config(**fsdp("optim_grads_params", bf16=True)))
    out["ddp_bf16"] = train(tiny_config(bf16=True))
    out["zero3_nan"] = train(tiny_config(**fsdp("optim_grads_params")), nan_at=1)
    # checkpoints: ZeRO-3 (no offload) and ZeRO-3 with half the optimizer offloaded, saved after step 2
    out["zero3_save"] = train(tiny_config(**fsdp("optim_grads_params", save=f"{root}/z3")), save_after=2)
    out["offload"] = train(tiny_config(**fsdp("optim_grads_params", optimizer_cpu_offload=True,
                                              optimizer_offload_fraction=0.5, save=f"{root}/off")), save_after=2)
    out["offload_plain"] = train(tiny_config(optimizer_cpu_offload=True))
    out["off_to_zero1"] = train(tiny_config(use_distributed_optimizer=True, load=f"{root}/off"), steps=1)
    out["z3_to_offload"] = train(tiny_config(optimizer_cpu_offload=True, load=f"{root}/z3"), steps=1)
    return out


def _world4(rank, world, root):
    out = {s: train(tiny_config(**fsdp(s))) for s in STRATEGIES}
    for s in ("optim_grads", "optim_grads_params"):
        out[f"tp2sp_{s}"] = train(tiny_config(**fsdp(s, tensor_model_parallel_size=2, sequence_parallel=True)))
    out["pp2_optim_grads_params"] = train(tiny_config(**fsdp("optim_grads_params", pipeline_model_parallel_size=2)))
    out["cp2_optim_grads_params"] = train(tiny_config(**fsdp("optim_grads_params", context_parallel_size=2)))
    out["moe_ep2_optim_grads_params"] = train(tiny_config("llama", **MOE, **fsdp(
        "optim_grads_params", expert_model_parallel_size=2)))
    # resume: the DP2 ZeRO-3 checkpoint at DP4 ZeRO-1 and at TP2 x DP2 ZeRO-3; a DP4 ZeRO-1 one at DP4 ZeRO-3
    out["z3_to_dp4_zero1"] = train(tiny_config(use_distributed_optimizer=True, load=f"{root}/z3"), steps=1)
    out["z3_to_tp2_zero3"] = train(tiny_config(**fsdp("optim_grads_params", tensor_model_parallel_size=2,
                                                      load=f"{root}/z3")), steps=1)
    out["z1_save"] = train(tiny_config(use_distributed_optimizer=True, save=f"{root}/z1"), save_after=2)
    out["z1_to_dp4_zero3"] = train(tiny_config(**fsdp("optim_grads_params", load=f"{root}/z1")), steps=1)
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharded_ckpt"))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, ckpt_root):
    return run_ranks(2, _world2, ckpt_root, tmp_dir=tmp_path_factory.mktemp("dp2"))


@pytest.fixture(scope="module")
def dp4(tmp_path_factory, ckpt_root, dp2):
    return run_ranks(4, _world4, ckpt_root, tmp_dir=tmp_path_factory.mktemp("dp4"))


@pytest.fixture(scope="module")
def reference():
    """One rank, the same global batches."""
    run = lambda *a, **kw: train(tiny_config(*a, world_size=1, **kw))  # noqa: E731
    return {"gpt": run(), "bf16": run(bf16=True), "moe": run("llama", **MOE)}


def merged(results: list[dict], name: str) -> dict:
    """One case over the ranks: rank 0's losses (the last pipeline stage's for PP) and every stage's params."""
    out = {"losses": [], "params": {}}
    for r in results:
        out["params"].update(r[name]["params"])
        out["losses"] = r[name]["losses"] if r[name]["losses"] and math.isfinite(r[name]["losses"][0]) else out[
            "losses"]
    return out


def assert_same(ref: dict, got: dict, last: int = STEPS, rtol: float = 1e-5) -> None:
    """``got``'s losses equal ``ref``'s last ones (a resumed run: its steps are ref's last) and the params."""
    want = ref["losses"][len(ref["losses"]) - len(got["losses"]):]
    assert len(got["losses"]) and len(want) == len(got["losses"])
    for a, b in zip(want, got["losses"]):
        assert abs(a - b) <= rtol * abs(a), f"loss {b} vs one rank's {a}"
    assert ref["params"].keys() == got["params"].keys()
    for k, a in ref["params"].items():
        err = ((a - got["params"][k]).norm() / a.norm().clamp(min=1e-12)).item()
        assert err <= rtol, f"{k}: relative difference {err:.2e}"


CASES2 = [*STRATEGIES, "zero2_overlap", "zero3_overlap", "zero3_recompute", "zero3_save", "offload", "offload_plain"]
CASES4 = [*STRATEGIES, "tp2sp_optim_grads", "tp2sp_optim_grads_params", "pp2_optim_grads_params",
          "cp2_optim_grads_params"]


@pytest.mark.parametrize("world,name", [(2, c) for c in CASES2] + [(4, c) for c in CASES4])
def test_sharded_run_equals_one_rank(dp2, dp4, reference, world, name):
    assert_same(reference["gpt"], merged(dp2 if world == 2 else dp4, name))


def test_bf16_zero3_equals_zero1_and_moe_expert_sharding_equals_one_rank(dp2, dp4, reference):
    """bf16: the losses equal one rank's; ZeRO-3's bf16 parameters are as close to ZeRO-1's as plain DDP's are.
    They are not equal: Adam's first steps move each weight by about the sign of its gradient, so a last-bit
    difference in a near-zero gradient entry (the layouts sum the squared norm and the buckets in another order)
    moves that bf16 weight by a whole step, about 1e-3 of the weights in three steps, in every layout alike."""
    zero3, zero1, ddp = merged(dp2, "zero3_bf16"), merged(dp2, "zero1_bf16"), merged(dp2, "ddp_bf16")
    for a, b in zip(reference["bf16"]["losses"], zero3["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)

    def distance(a: dict, b: dict, keys) -> float:
        diff = sum(((a["params"][k] - b["params"][k]) ** 2).sum() for k in keys)
        return (diff / sum((a["params"][k] ** 2).sum() for k in keys)).sqrt().item()
    keys = list(zero1["params"])
    assert zero3["params"].keys() == zero1["params"].keys() == ddp["params"].keys()
    assert distance(zero1, zero3, keys) <= 2 * distance(zero1, ddp, keys) + 1e-6
    for k in keys:
        assert distance(zero1, zero3, [k]) <= 3 * distance(zero1, ddp, [k]) + 1e-4, k
    assert_same(reference["moe"], merged(dp4, "moe_ep2_optim_grads_params"))


def test_per_token_loss_scales_the_gradient_shards(dp2):
    """--calculate-per-token-loss divides the reduced gradients by the global token count: under ZeRO-3 the
    shards, as ZeRO-1 its whole buffer."""
    assert_same(merged(dp2, "zero1_per_token"), merged(dp2, "zero3_per_token"))


@pytest.mark.parametrize("world,name", [(2, "off_to_zero1"), (2, "z3_to_offload"), (4, "z3_to_dp4_zero1"),
                                        (4, "z3_to_tp2_zero3"), (4, "z1_to_dp4_zero3")])
def test_resume_across_strategies_sizes_tp_and_offload(dp2, dp4, reference, world, name):
    """Saved after 2 steps in one layout, one more step in another: the third step of the one-rank run."""
    assert_same(reference["gpt"], merged(dp2 if world == 2 else dp4, name))


def test_per_rank_bytes_equal_the_predicted_shares(dp2, dp4):
    for results in (dp2, dp4):
        for r in results:
            for name in (*STRATEGIES, "tp2sp_optim_grads_params", "moe_ep2_optim_grads_params"):
                if name not in r:
                    continue
                got, pred, pad = r[name]["bytes"], r[name]["predicted"], r[name]["padding"]
                for k in ("params", "grads", "optimizer"):
                    assert pred[k] - pad[k] <= got[k] <= pred[k] + pad[k], (name, k, got[k], pred[k])
    for results, dp in ((dp2, 2), (dp4, 4)):
        full, z3 = results[0]["no_shard"]["bytes"], results[0]["optim_grads_params"]["bytes"]
        for k in ("params", "grads", "optimizer"):  # each sharded to about 1/DP (padding aside)
            assert abs(z3[k] * dp - full[k]) <= 0.02 * full[k], (dp, k, z3[k], full[k])
        z2 = results[0]["optim_grads"]["bytes"]
        assert z2["params"] == full["params"] and abs(z2["grads"] * dp - full["grads"]) <= 0.02 * full["grads"]


def test_offload_keeps_half_the_optimizer_on_the_host(dp2):
    for r in dp2:
        b = r["offload"]["bytes"]
        assert 0.3 * b["optimizer"] <= b["optimizer_host"] <= b["optimizer"]
        assert r["offload_plain"]["bytes"]["optimizer_host"] > 0
        assert r["no_shard"]["bytes"]["optimizer_host"] == 0


def test_overlap_param_gather_prefetches_the_next_layer_under_zero3(dp2):
    """Each micro-batch's forward starts layer 1's gather from the root's and layer 2's from layer 1's, its
    backward layer 1's from layer 2's (the root is never prefetched): 3 per micro-batch, 2 micro-batches a step."""
    for r in dp2:
        assert r["zero3_overlap"]["prefetches"] == 3 * 2 * STEPS
        assert r["optim_grads_params"]["prefetches"] == 0


def test_nan_gradient_in_one_shard_stops_every_rank(dp2):
    """The NaN is in data-parallel rank 0's gradient shard only: the global norm over shards carries it to
    rank 1, which stops too (a rank that went on would hang the next collective)."""
    for r in dp2:
        assert "gradient norm is nan" in r["zero3_nan"]["error"]
