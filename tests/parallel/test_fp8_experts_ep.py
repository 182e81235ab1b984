"""The routed experts' fused FP8 MLP (paratron/fp8/experts_mlp.py) under expert parallelism on CPU/gloo: EP 2 with
the alltoall dispatcher and --moe-permute-fusion stays close to the one-rank FP8 run (each rank scales its own
experts' rows, so only approximately equal, as FP8 under TP) and every rank ran the fused function."""
from pathlib import Path

import torch

from paratron import fp8
from tests.dist import run_ranks
from tests.parallel.common import run_steps, tiny_config

STEPS = 3
ROOT = Path(__file__).resolve().parents[2]
MOE = dict(bf16=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
           moe_permute_fusion=True, moe_aux_loss_coeff=1e-2)
FP8 = dict(fp8_format="e4m3", fp8_recipe="tensorwise",
           te_precision_config_file=str(ROOT / "paratron" / "configs" / "precision" / "moe_experts_fp8.yaml"))


def _counted(flags: dict, **layout) -> dict:
    from paratron.fp8 import experts_mlp
    fp8.device_problem = lambda device: None
    calls, real = [], experts_mlp.fused_experts_mlp
    experts_mlp.fused_experts_mlp = lambda *a: calls.append(1) or real(*a)
    try:
        out = run_steps(tiny_config("llama", **layout, **MOE, **flags), STEPS)
    finally:
        experts_mlp.fused_experts_mlp = real
    return {**out, "fused_calls": len(calls)}


def _rank(rank, world, flags):
    return _counted(flags, expert_model_parallel_size=world)


def _dist(x, y):
    num = sum((x["params"][n].float() - y["params"][n].float()).norm() ** 2 for n in x["params"])
    return (num / sum(x["params"][n].float().norm() ** 2 for n in x["params"])).sqrt().item()


def test_ep2_fused_fp8_experts_close_to_one_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8, "device_problem", lambda device: None)
    ref = _counted(FP8, world_size=1)
    bf16 = _counted({}, world_size=1)
    assert ref["fused_calls"] > 0 and bf16["fused_calls"] == 0 and ref["losses"] != bf16["losses"]
    fp8_noise = _dist(ref, bf16)  # how far FP8 moves the weights from bf16 in these steps
    for r in run_ranks(2, _rank, FP8, tmp_dir=tmp_path):
        assert r["fused_calls"] > 0
        for a, b in zip(ref["losses"], r["losses"]):
            assert abs(a - b) <= 2e-3 * abs(a) and torch.isfinite(torch.tensor(b))
        assert _dist(ref, r) <= 2 * fp8_noise, (_dist(ref, r), fp8_noise)
