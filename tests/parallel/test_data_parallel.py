"""Data parallelism, the distributed optimizer and mixed precision on CPU/gloo.

Each world size is spawned once (module fixtures) and runs every variant in turn; the tests then
compare what the ranks returned with single-process runs of the same global batch."""
from __future__ import annotations

import faulthandler
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from paratron.parallel.tensor import gather_full
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, global_batches, micro_batches, tiny_config

STEPS = 3
BUCKET = 4000  # elements: the tiny model splits into 9 buckets (a large matrix fills one alone)
DISTOPT = {"use_distributed_optimizer": True}
OVERLAP = {"overlap_grad_reduce": True, "ddp_bucket_size": BUCKET}
ALL_OVERLAP = dict(DISTOPT, overlap_param_gather=True, **OVERLAP)
RAMP = {"rampup_batch_size": [4, 4, 8]}  # global batch 4, 4, then 8 (mbs 2: 1 rank and DP=2 alike)
FP16 = {"fp16": True, "loss_scale": None, "initial_loss_scale": 1024.0, "hysteresis": 1}
ROOT = Path(__file__).resolve().parents[2]


def train(cfg, steps: int = STEPS, inject_inf_at: int | None = None, save_after: int | None = None) -> dict:
    """``steps`` real training steps (Trainer.train_step) on this process's layout; what the tests
    compare. ``inject_inf_at``: at that step, data-parallel rank 0's loss is multiplied by inf (its
    gradients overflow before the reduction). ``save_after``: save a checkpoint (to --save) after that step."""
    from paratron.train.loop import Trainer, build_dims
    dims = build_dims(cfg)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(iter(()), None))
    start = trainer.consumed_samples  # > 0 after loading a checkpoint
    trainer.train_iter = micro_batches(global_batches(cfg, steps + trainer.iteration)[start:], cfg, dims.dp_rank,
                                       dims.dp)
    if inject_inf_at is not None:
        inner = trainer.forward_step

        def forward_step(data_iterator, model):
            output, loss_func = inner(data_iterator, model)
            if trainer.iteration == inject_inf_at and dims.dp_rank == 0:
                output = output * float("inf")
            return output, loss_func
        trainer.forward_step = forward_step
    out = {k: [] for k in ("losses", "norms", "ok", "scale", "gbs", "microbatches", "consumed", "in_backward",
                           "probe")}
    for _ in range(steps):
        out["microbatches"].append(trainer.num_microbatches)
        report, ok, norm = trainer.train_step()
        trainer.model.finish_param_sync()
        out["losses"].append((report[0] / report[1]).item())
        out["norms"].append(norm)
        out["ok"].append(ok)
        out["scale"].append(trainer.optimizer.loss_scale)
        out["gbs"].append(trainer.current_global_batch)
        out["consumed"].append(trainer.consumed_samples)
        out["in_backward"].append(trainer.model.buckets_launched_in_backward)
        out["probe"].append(trainer.model.params[0].detach().float().clone())
        if save_after is not None and trainer.iteration == save_after:
            trainer.save()
    out["params"] = {n: gather_full(p, dims.tp_group).float().clone() for n, p in trainer.model.module.named_parameters()}
    out["layer_offset"] = trainer.model.module.decoder.layer_offset  # pipeline stages name layers locally
    out["buckets"] = len(trainer.model.buckets)
    out["master_dtypes"] = sorted({str(m.dtype) for m in trainer.optimizer.masters})
    out["grad_dtype"] = str(trainer.model.grad_buffer.dtype)
    out["state_bytes"] = trainer.optimizer.state_bytes()
    trainer.close()
    return out


def cfg_of(style="gpt", **kw):
    return tiny_config(style, **kw)


def assert_parity(ref: dict, got: dict, rtol: float = 1e-5) -> None:
    """Losses and parameters (common.assert_close_runs) and the global gradient norms, which decide
    clipping (the GPT runs clip at steps 1 and 2: norms 1.36 and 1.24 > --clip-grad 1)."""
    assert_close_runs(ref, got, rtol)
    for i, (a, b) in enumerate(zip(ref["norms"], got["norms"])):
        assert abs(a - b) <= rtol * abs(a), f"step {i}: grad norm {b} vs reference {a}"


VARIANTS_DP2 = {
    "plain": ("gpt", {}),
    "distopt": ("gpt", DISTOPT),
    "overlap_off": ("gpt", {"ddp_bucket_size": BUCKET}),
    "overlap_on": ("gpt", OVERLAP),
    "distopt_overlap_off": ("gpt", dict(DISTOPT, ddp_bucket_size=BUCKET)),
    "distopt_overlap_on": ("gpt", ALL_OVERLAP),
    "llama_distopt_overlap": ("llama", ALL_OVERLAP),
    "rampup": ("gpt", RAMP),
    "bf16": ("gpt", {"bf16": True}),
    "bf16_distopt_overlap": ("gpt", dict(ALL_OVERLAP, bf16=True)),
    "bf16_grad_reduce_in_bf16": ("gpt", dict(DISTOPT, bf16=True, grad_reduce_in_bf16=True)),
}
VARIANTS_DP4 = {
    "plain": ("gpt", {}),
    "distopt_overlap_on": ("gpt", ALL_OVERLAP),
    "overlap_off": ("gpt", {"ddp_bucket_size": BUCKET}),
    "overlap_on": ("gpt", OVERLAP),
    "distopt_overlap_off": ("gpt", dict(DISTOPT, ddp_bucket_size=BUCKET)),
}


def _dp_rank(rank, world, variants, ckpt_dir):
    out = {name: train(cfg_of(style, **kw)) for name, (style, kw) in variants.items()}
    if world == 2:
        for name, extra in (("fp16", {}), ("fp16_distopt", DISTOPT)):
            out[name] = train(cfg_of(**FP16, **extra), steps=4, inject_inf_at=1)
        # checkpoint of the distributed optimizer (bf16: masters are saved): 3 straight steps vs 2 + resume + 1
        straight = train(cfg_of(**ALL_OVERLAP, bf16=True, save=ckpt_dir), save_after=2)
        cfg = cfg_of(**ALL_OVERLAP, bf16=True, load=ckpt_dir)
        out["resume"] = {"straight": straight, "resumed": train(cfg, steps=1)}
        out["no_sync_probe"] = no_sync_probe()
    if world == 4:
        spec = importlib.util.spec_from_file_location("optimizer_memory", ROOT / "benchmarks" / "optimizer_memory.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out["memory"] = {p: bench.measure(p, True) for p in ("fp32", "bf16")}
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    return run_ranks(2, _dp_rank, VARIANTS_DP2, str(tmp / "ckpt"), tmp_dir=tmp)


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp4")
    return run_ranks(4, _dp_rank, VARIANTS_DP4, None, tmp_dir=tmp)


@pytest.fixture(scope="module")
def reference():
    """Single-process runs with the same global batches."""
    return {"gpt": train(cfg_of()), "llama": train(cfg_of("llama")), "rampup": train(cfg_of(**RAMP)),
            "bf16": train(cfg_of(bf16=True))}


# ---- parity with one rank ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "distopt", "overlap_on", "distopt_overlap_on", "llama_distopt_overlap"])
def test_dp2_equals_single_rank(dp2, reference, name):
    ref = reference["llama" if name.startswith("llama") else "gpt"]
    for r in dp2:
        assert_parity(ref, r[name])


@pytest.mark.parametrize("name", ["plain", "distopt_overlap_on", "overlap_on", "distopt_overlap_off"])
def test_dp4_equals_single_rank(dp4, reference, name):
    for r in dp4:
        assert_parity(reference["gpt"], r[name])


def test_distributed_optimizer_equals_plain(dp2, dp4):
    for r in dp2:
        assert_parity(r["plain"], r["distopt"])
    for results in (dp2, dp4):
        for r in results:
            assert_parity(r["overlap_off"], r["distopt_overlap_off"])
            assert_parity(r["overlap_off"], r["distopt_overlap_on"])


# ---- overlap ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("off,on", [("overlap_off", "overlap_on"), ("distopt_overlap_off", "distopt_overlap_on")])
def test_overlap_is_bitwise_equal_to_no_overlap(dp2, dp4, off, on):
    for results in (dp2, dp4):
        for r in results:
            a, b = r[off], r[on]
            assert a["buckets"] == b["buckets"] >= 8
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
            for n in a["params"]:
                assert torch.equal(a["params"][n], b["params"][n]), n


def test_overlap_launches_every_bucket_during_backward(dp2, dp4):
    for results in (dp2, dp4):
        for r in results:
            assert r["overlap_on"]["in_backward"] == [r["overlap_on"]["buckets"]] * STEPS
            assert r["distopt_overlap_on"]["in_backward"] == [r["distopt_overlap_on"]["buckets"]] * STEPS
            assert r["overlap_off"]["in_backward"] == [0] * STEPS


def no_sync_probe() -> str:
    """Two micro-batches with --overlap-grad-reduce but without no_sync(): the error message."""
    from paratron.train.loop import Trainer, build_dims
    cfg = cfg_of(**OVERLAP)
    dims = build_dims(cfg)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims,
                      data=(micro_batches(global_batches(cfg, 1), cfg, dims.dp_rank, dims.dp), None))
    trainer.model.zero_grad_buffer()
    for _ in range(2):  # two micro-batches without no_sync(): the second one must be refused
        output, loss_func = trainer.forward_step(trainer.train_iter, trainer.model)
        loss_sum, n, _ = loss_func(output)
        try:
            (loss_sum / n).backward()
        except RuntimeError as e:
            return str(e)
    return "no error"


def test_overlap_without_no_sync_fails_loudly(dp2):
    for r in dp2:
        assert "no_sync" in r["no_sync_probe"]


# ---- mixed precision -------------------------------------------------------------------------------
def assert_close_bf16(ref: dict, got: dict, loss_rtol: float = 1e-4, param_rtol: float = 2e-3) -> None:
    """bf16 runs: fp32 gradient sums in another order flip the bf16 rounding of a few parameters, and
    Adam turns a flipped near-zero gradient into a full step on that element, so small tensors (norm
    biases) can differ by a few per cent. Compare the losses and all parameters as one vector."""
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {i}: loss {b} vs reference {a}"
    a = torch.cat([p.flatten() for p in ref["params"].values()])
    b = torch.cat([got["params"][n].flatten() for n in ref["params"]])
    err = ((a - b).norm() / a.norm()).item()
    assert err <= param_rtol, f"parameters: relative difference {err:.2e}"


def test_bf16_data_parallel_keeps_fp32_masters_and_matches_single_rank(dp2, reference):
    ref = reference["bf16"]
    assert ref["master_dtypes"] == ["torch.float32"] and ref["grad_dtype"] == "torch.float32"
    for r in dp2:
        for name in ("bf16", "bf16_distopt_overlap"):
            got = r[name]
            assert got["master_dtypes"] == ["torch.float32"] and got["grad_dtype"] == "torch.float32"
            assert_close_bf16(ref, got)
        got = r["bf16_grad_reduce_in_bf16"]
        assert got["grad_dtype"] == "torch.bfloat16" and got["master_dtypes"] == ["torch.float32"]
        assert_close_bf16(ref, got, loss_rtol=1e-3, param_rtol=5e-3)


@pytest.mark.parametrize("name", ["fp16", "fp16_distopt"])
def test_fp16_scaler_skips_inf_step_on_every_rank_and_recovers(dp2, name):
    runs = [r[name] for r in dp2]
    for r in runs:
        assert r["ok"] == [True, False, True, True]  # rank 0's overflow reaches every rank
        assert r["scale"] == [1024.0, 512.0, 512.0, 512.0]  # hysteresis 1: back off at once
        assert torch.equal(r["probe"][1], r["probe"][0])  # the skipped step left the weights alone
        assert not torch.equal(r["probe"][2], r["probe"][1])
        assert all(torch.isfinite(p).all() for p in r["params"].values())
        assert all(x == x and abs(x) < 1e3 for i, x in enumerate(r["losses"]) if i != 1)
    for n in runs[0]["params"]:
        assert torch.equal(runs[0]["params"][n], runs[1]["params"][n]), n  # replicas stay identical


def test_fp16_overflow_is_skipped_and_counted_in_the_log_line(capsys):
    """Megatron's default initial scale 2^32 overflows fp16 gradients: the first steps are skipped,
    counted in the log line, and the scale backs off after ``--hysteresis`` (2) overflows."""
    from paratron.train.loop import Trainer, build_dims
    cfg = cfg_of(fp16=True)
    dims = build_dims(cfg)
    data = micro_batches(global_batches(cfg, STEPS), cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(data, None))
    before = trainer.model.params[0].detach().clone()
    trainer.train()
    trainer.close()
    out = capsys.readouterr().out
    assert [int(x) for x in re.findall(r"number of skipped iterations:\s+(\d+)", out)] == [1, 2, 3]
    assert [float(x) for x in re.findall(r"loss scale: ([0-9.]+)", out)] == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30]
    assert torch.equal(trainer.model.params[0], before)


# ---- batch-size ramp -------------------------------------------------------------------------------
def test_rampup_batch_sizes_and_parity(dp2, reference):
    ref = reference["rampup"]
    assert ref["gbs"] == [4, 4, 8] and ref["consumed"] == [4, 8, 16]
    assert ref["microbatches"] == [2, 2, 4]  # mbs 2 on one rank
    for r in dp2:
        got = r["rampup"]
        assert got["gbs"] == [4, 4, 8] and got["consumed"] == [4, 8, 16]
        assert got["microbatches"] == [1, 1, 2]  # mbs 2 x DP 2
        assert_parity(ref, got)


# ---- checkpoint of the distributed optimizer --------------------------------------------------------
def test_distributed_optimizer_checkpoint_resumes_bit_exactly(dp2):
    for r in dp2:
        straight, resumed = r["resume"]["straight"], r["resume"]["resumed"]
        assert resumed["losses"] == straight["losses"][2:]
        for n, p in straight["params"].items():
            assert torch.equal(p, resumed["params"][n]), n


# ---- memory ------------------------------------------------------------------------------------------
def test_distributed_optimizer_state_memory_at_dp4(dp4):
    spec = importlib.util.spec_from_file_location("optimizer_memory", ROOT / "benchmarks" / "optimizer_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    single = {p: bench.measure(p, False) for p in ("fp32", "bf16")}
    for r in dp4:
        for precision, ratio in bench.report(single, r["memory"], 4):
            assert ratio <= 0.30, f"{precision}: distributed optimizer state at DP=4 is {100 * ratio:.1f} % of DP=1"
    for r in dp4:  # and in the parity runs: the sharded state is about a quarter of the plain one
        assert r["distopt_overlap_on"]["state_bytes"] <= 0.30 * r["plain"]["state_bytes"]


# ---- TP x PP x DP ------------------------------------------------------------------------------------
def _tp_pp_dp_rank(rank, world):
    from paratron.train.loop import build_dims
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test with every rank's stack
    out = {}
    for name, kw in (("plain", {}), ("distopt_overlap", dict(DISTOPT, **OVERLAP))):
        cfg = cfg_of(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, **kw)
        dims = build_dims(cfg)
        out[name] = dict(train(cfg), last_stage=dims.is_last_stage, first_dp=dims.dp_rank == 0)
    return out


def merge_stages(runs: list[dict]) -> dict:
    """The full model from the stages of data-parallel rank 0: local layer numbers made global; the
    last stage's copy of the tied embedding must equal the first stage's word embedding."""
    params = {}
    for r in runs:
        if not r["first_dp"]:
            continue
        for n, p in r["params"].items():
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", n)
            if m:
                n = f"decoder.layers.{int(m.group(1)) + r['layer_offset']}.{m.group(2)}"
            params.setdefault(n, p)
    copy = params.pop("output_layer.weight", None)
    if copy is not None and "embedding.word_embeddings.weight" in params:
        assert torch.equal(copy, params["embedding.word_embeddings.weight"]), "tied embedding copies differ"
    return params


def test_tp2_pp2_dp2_equals_single_rank(tmp_path, reference):
    ref = reference["gpt"]
    results = run_ranks(8, _tp_pp_dp_rank, tmp_dir=tmp_path)
    for name in ("plain", "distopt_overlap"):
        runs = [r[name] for r in results]
        for r in runs:
            if r["last_stage"]:  # losses are reported on the last stage; every rank has the norm
                assert_close_runs(dict(ref, params={}), dict(r, params={}))
            assert_parity(dict(ref, losses=[], params={}), dict(r, losses=[], params={}))
        assert_close_runs(dict(ref, losses=[]), {"losses": [], "params": merge_stages(runs)})
