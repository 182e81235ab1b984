"""Sliding windows, learnable attention sinks (sharded by heads) and YaRN under TP 2 (with and without
sequence parallelism) equal the one-rank run: losses and every parameter after a few training steps."""
import pytest

from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, run_steps, tiny_config

STEPS = 3
VARIANTS = dict(window_size="7,0", window_attn_skip_freq="2", softmax_type="learnable",
                position_embedding_type="yarn", rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16)


def _rank(rank, world, sp):
    return run_steps(tiny_config("llama", tensor_model_parallel_size=world, sequence_parallel=sp, **VARIANTS), STEPS)


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_equals_single_rank(tmp_path, sp):
    ref = run_steps(tiny_config("llama", **VARIANTS), STEPS)
    sinks = [n for n in ref["params"] if n.endswith("core_attention.softmax_offset")]
    assert len(sinks) == 2 and ref["params"][sinks[0]].shape == (8,)
    for r in run_ranks(2, _rank, sp, tmp_dir=tmp_path):
        assert_close_runs(ref, r)
