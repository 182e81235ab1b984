"""FlashAttention-4's and the residual-keeping RMSNorm's wiring under TP + SP on CPU/gloo: with the
attention op on its CPU reference (paratron/kernels/flash_attention.py) and the norm on quack's reference
(kernels/quack_norm.py: rms_norm_keep), TP2 + SP training equals the plain one-rank run: each rank's
heads through the sequence-first op, the residual handed on by the norm and added inside the row-parallel
output projection after its reduction. The kernels themselves run in tests/gpu."""
from paratron.kernels import flash_attention
from paratron.kernels import quack_norm
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 3


def _rank(rank, world):
    calls = {"flash": 0, "keep": 0}
    flash_attention.wanted = lambda *a: True
    quack_norm.available = lambda *a: True  # Norm.quack
    real_keep = quack_norm.rms_norm_keep

    def counted(fn):  # the plain flash op, or the one with the rotary embedding inside (llama's path)
        def call(*a):
            calls["flash"] += 1
            return fn(*a)
        return call

    def keep(*a):
        calls["keep"] += 1
        return real_keep(*a)
    flash_attention.causal_attention = counted(flash_attention.causal_attention)
    flash_attention.rotary_causal_attention = counted(flash_attention.rotary_causal_attention)
    quack_norm.rms_norm_keep = keep
    out = run_steps(tiny_config("llama", tensor_model_parallel_size=world, sequence_parallel=True,
                                attention_backend="fused"), STEPS)  # asked: "auto" finds no FA4 on a CPU
    out["calls"] = calls
    return out


def test_tp2_sp_flash_attention_and_residual_norms_equal_plain_single_rank(tmp_path):
    ref = run_steps(tiny_config("llama", world_size=1), STEPS)
    for r in run_ranks(2, _rank, tmp_dir=tmp_path):
        assert r["calls"]["flash"] > 0 and r["calls"]["keep"] > 0, r["calls"]
        assert_close_runs(ref, r)
