"""--fp8-param-gather on CPU/gloo (CPU stands in for an FP8 GPU, as in test_fp8_tp.py): the parameter
all-gather of ZeRO-1 and ZeRO-3 moves e4m3 bytes with one scale per weight, the weights it writes are exactly
the local FP8 casts of the full weights, and training with it follows training without it."""
import pytest
import torch

from paratron import fp8
from paratron.kernels.fp8_cast import E4M3, FMAX, compute_scale, dequantize, quantize
from paratron.parallel import comm, fp8_gather
from tests.dist import run_ranks
from tests.parallel.test_sharded_dp import fsdp, train
from tests.parallel.common import tiny_config

FP8 = dict(bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise")
pytestmark = pytest.mark.slow  # (one launch of 2 ranks; FP8 matmuls on CPU are slow)
LAYOUTS = {"zero1": dict(use_distributed_optimizer=True), "zero3": fsdp("optim_grads_params")}


def _gathers(cfg) -> list:
    """For each FP8 bucket of a fresh Trainer's model: (gathered dtype, largest difference between the
    weights the FP8 gather wrote and the local FP8 casts of the bf16 weights gathered plainly, FP8 weights)."""
    from paratron.train.loop import Trainer, build_dims
    t = Trainer(cfg, device=torch.device("cpu"), dims=build_dims(cfg), data=(iter(()), None))
    out = []
    for buf in t.model.grad_buffers:
        if not buf.fp8:
            continue
        for b in buf.buckets:
            plain = torch.empty(b.numel, dtype=torch.bfloat16)
            comm.all_gather_single(plain, buf.param_shard(b), group=buf.group)
            got = torch.empty_like(plain)
            full, _ = fp8_gather.gather(buf, b, got)
            worst = 0.0
            for p in b.params:
                a = buf.offsets[p] - b.start
                w = plain[a: a + p.numel()]
                s = compute_scale(w.float().abs().amax(), FMAX[E4M3])
                want = dequantize(quantize(w, s, E4M3), s, torch.bfloat16)
                worst = max(worst, (got[a: a + p.numel()].float() - want.float()).abs().max().item())
            out.append((full.dtype, worst, len(b.params)))
    t.close()
    return out


def _rank(rank, world):
    fp8.device_problem = lambda device: None
    out = {name: _gathers(tiny_config("llama", **FP8, **kw, fp8_param_gather=True)) for name, kw in LAYOUTS.items()}
    zero3 = LAYOUTS["zero3"]  # (ZeRO-1's gather is the same code, run after the step instead of per layer)
    out["zero3_on"] = train(tiny_config("llama", **FP8, **zero3, fp8_param_gather=True))["losses"]
    out["zero3_off"] = train(tiny_config("llama", **FP8, **zero3))["losses"]
    fp32 = dict(FP8, bf16=False)  # FP8 matmuls with fp32 weights (Megatron's deepseek_proxy_fsdp_ep2_fsdp2 config)
    out["zero3_fp32_on"] = train(tiny_config("llama", **fp32, **zero3, fp8_param_gather=True))["losses"]
    out["zero3_fp32_off"] = train(tiny_config("llama", **fp32, **zero3))["losses"]
    return out


def test_fp8_param_gather_moves_fp8_and_writes_the_local_casts(tmp_path):
    for r in run_ranks(2, _rank, tmp_dir=tmp_path):
        for name in LAYOUTS:
            assert r[name] and sum(n for _, _, n in r[name]) == 8  # QKV, proj, fc1, fc2 of 2 layers
            for dtype, worst, _ in r[name]:
                assert dtype == torch.float8_e4m3fn and worst == 0.0
        for dtype in ("", "_fp32"):
            on, off = r[f"zero3{dtype}_on"], r[f"zero3{dtype}_off"]  # (tensorwise: the layer's re-cast of the
            assert len(on) == len(off) == 3  # gathered cast is that cast: the losses agree far closer than this)
            for a, b in zip(off, on):
                assert abs(a - b) <= 1e-3 * abs(a), (dtype, off, on)
