"""Megatron's variants on sharded weights equal the one-rank run: zero-centred norms (--apply-layernorm-1p,
q/k layernorm included) under TP2 with sequence parallelism; quick-GeGLU with offset and clamp and the
attention output gate under TP2; the Muon optimizer under TP2 (the matrices gathered whole for
Newton-Schulz) and over two data-parallel ranks with the distributed optimizer (momentum shards
gathered), with --decoupled-lr on the embedding and output layer."""
import pytest

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 2
CASES = {
    "layernorm_1p_sp": ("llama", dict(apply_layernorm_1p=True, qk_layernorm=True), dict(sequence_parallel=True)),
    "quick_geglu_gate": ("gpt", dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.05,
                                     attention_output_gate=True), {}),
    "muon_decoupled": ("llama", dict(optimizer="muon", muon_fp32_matmul_prec="highest", decoupled_lr=3e-2,
                                     decoupled_min_lr=1e-3, lr_decay_style="cosine"), {}),
}


def _config(case: str, world: int, layout: str):
    style, options, extra = CASES[case]
    parallel = {"tp": dict(tensor_model_parallel_size=world, **extra), "dp": dict(use_distributed_optimizer=True),
                "one": {}}[layout]
    return tiny_config(style, world_size=world, **options, **parallel)


def _rank(rank, world, case, layout):
    return run_steps(_config(case, world, layout), STEPS)


@pytest.mark.parametrize("case,layout", [("layernorm_1p_sp", "tp"), ("quick_geglu_gate", "tp"),
                                         ("muon_decoupled", "tp"), ("muon_decoupled", "dp")])
def test_variant_equals_single_rank(tmp_path, case, layout):
    ref = run_steps(_config(case, 1, "one"), STEPS)
    for r in run_ranks(2, _rank, case, layout, tmp_dir=tmp_path):
        assert_close_runs(ref, r, rtol=2e-5)
