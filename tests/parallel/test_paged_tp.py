"""The paged engine at TP = 2 (gloo) equals TP = 1: mixed-length requests with chunked prefill, a shared prefix
through the prefix cache, a pool small enough to preempt, greedy, seeded sampling and log-probabilities, for a
Llama and a DeepSeek-V3 (multi-latent attention); rank 0 leads every step and rank 1 follows
(paratron.inference.runtime.Group.paged / follow)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from paratron.config.inference import InferenceConfig  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.load import load_for_inference  # noqa: E402
from paratron.inference.runtime import Group  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from paratron.parallel.dims import initialize_model_parallel  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402

SHARED = [7, 8, 9, 10, 11, 12, 13, 14]
PROMPTS = [SHARED + [20, 21], [5, 6], SHARED + [30], [3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [11, 12, 13]]
PARAMS = [SamplingParams(max_new_tokens=9, logprobs=True), SamplingParams(max_new_tokens=12),
          SamplingParams(max_new_tokens=7, temperature=1.0, seed=5), SamplingParams(max_new_tokens=10),
          SamplingParams(max_new_tokens=6, logprobs=True, top_k=5, temperature=0.7, seed=1)]
CFG = InferenceConfig(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
                      inference_dynamic_batching_num_blocks=12, inference_dynamic_batching_max_tokens=8,
                      enable_chunked_prefill=True, inference_dynamic_batching_prefix_caching=True)


def _paged(rank, world, source, ep=1, cfg=CFG):
    dims = initialize_model_parallel(world, expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if ep > 1
                                     else None)
    loaded = load_for_inference(source, dims)
    group = Group(Engine(loaded.model, loaded.vocab_size), dims)
    if rank != 0:
        group.follow()
        return None
    engine = group.paged(cfg)
    results = engine.generate([Request(p, sp) for p, sp in zip(PROMPTS, PARAMS)])
    again = engine.generate([Request([1, 2], SamplingParams(max_new_tokens=3))])  # a second round, blocks reused
    group.close()
    return [(r.tokens, r.logprobs) for r in results + again], engine.sched.preemptions, engine.sched.prefix_hits


@pytest.mark.parametrize("model,ep", [("llama", 1), ("deepseek", 1), ("deepseek", 2)])
def test_paged_engine_tp2_equals_tp1(tmp_path, model, ep):
    """A Llama checkpoint saved at TP 1 and loaded at TP 2; a DeepSeek-V3 (multi-latent attention: heads split
    over TP, the latent rows whole on every rank) from its Hugging Face directory, its experts also split whole
    over EP 2."""
    if model == "llama":
        source = str(make_tiny_checkpoint(tmp_path))
    else:
        from tests.parallel.test_generate_tp import _deepseek
        source = _deepseek(tmp_path)
    one, preempted, hits = _paged(0, 1, source)
    two = run_ranks(2, _paged, source, ep, tmp_dir=tmp_path)[0]
    assert preempted > 0 and hits > 0  # the small pool preempted and the shared prefix was reused
    assert two[1:] == (preempted, hits)
    for (t1, lp1), (t2, lp2) in zip(one, two[0]):
        assert t1 == t2
        if lp1 is not None:
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_paged_engine_tp2_equals_tp1_for_hybrid_stacks(tmp_path, name):
    """NemotronH (Mamba-2 heads and groups split over TP, their state rows too) and Qwen3-Next (Gated DeltaNet)
    from their Hugging Face directories: the paged engine at TP 2 gives TP 1's tokens (no prefix caching: a
    recurrent state is not kept per block)."""
    import dataclasses
    from tests.unit.test_hf_hybrid import hf_model
    hf_model(name).save_pretrained(tmp_path / name)
    cfg = dataclasses.replace(CFG, inference_dynamic_batching_prefix_caching=False,
                              inference_dynamic_batching_max_requests=3)
    one, preempted, _ = _paged(0, 1, str(tmp_path / name), 1, cfg)
    two = run_ranks(2, _paged, str(tmp_path / name), 1, cfg, tmp_dir=tmp_path)[0]
    assert preempted > 0 and two[1] == preempted
    for (t1, lp1), (t2, lp2) in zip(one, two[0]):
        assert t1 == t2
        if lp1 is not None:
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
