"""Generation at TP=2 (gloo) equals TP=1, and with the experts split over EP=2 too, from a one-rank paratron checkpoint resharded at load and from
a Hugging Face directory sliced at load (a Llama; a Mixtral: its experts split over expert-TP, the
tokens of odd-length prompts and of each decode step padded to share over TP; a DeepSeek-V3: multi-latent
attention's heads split over TP over its replicated latent cache, sigmoid-routed experts); rank 0 leads each batch,
rank 1 follows (paratron.inference.runtime.Group)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.load import load_for_inference  # noqa: E402
from paratron.inference.runtime import Group  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from paratron.parallel.dims import initialize_model_parallel  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41, 42]]
PARAMS = [SamplingParams(max_new_tokens=8, logprobs=True), SamplingParams(max_new_tokens=8, temperature=1.0, seed=5),
          SamplingParams(max_new_tokens=6, logprobs=True, top_k=5, temperature=0.7, seed=1)]


def _generate(rank, world, sources, ep=1):
    dims = initialize_model_parallel(world, expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if ep > 1
                                     else None)
    out = []
    for source in sources:  # a paratron checkpoint, and a Hugging Face directory
        loaded = load_for_inference(source, dims)
        group = Group(Engine(loaded.model, loaded.vocab_size), dims)
        if rank == 0:
            results = group.generate([Request(p, sp) for p, sp in zip(PROMPTS, PARAMS)])
            group.generate([Request([1, 2], SamplingParams(max_new_tokens=2))])  # a second batch
            group.close()
            out.append([(r.tokens, r.logprobs) for r in results])
        else:
            group.follow()
    return out


def _mixtral(d) -> str:
    from tests.unit.test_generate import hf_models
    from tests.unit.test_hf_parity import randomize
    cls, cfg = hf_models()["mixtral"]
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    randomize(hf)
    hf.save_pretrained(d / "mixtral")
    return str(d / "mixtral")


def _deepseek(d) -> str:
    from tests.unit.test_mla_generation import deepseek_model
    deepseek_model().save_pretrained(d / "deepseek")
    return str(d / "deepseek")


def test_tp2_generation_equals_tp1(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path)  # saved at TP 1 (vocabulary padded for TP 1), loaded at TP 2
    sources = [str(ckpt), str(tmp_path / "hf"), _mixtral(tmp_path), _deepseek(tmp_path)]
    one = _generate(0, 1, sources)
    two = run_ranks(2, _generate, sources, tmp_dir=tmp_path)[0]
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        for (t1, lp1), (t2, lp2) in zip(a, b):
            assert t1 == t2
            if lp1 is not None:
                assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)


def _local_experts(rank, world, source):
    from paratron.inference.runtime import start
    import os
    os.environ["WORLD_SIZE"] = str(world)
    dims, _ = start("cpu", ep=world)
    model = load_for_inference(source, dims).model
    return sorted({m.layout.local for m in model.modules() if hasattr(m, "layout")})


def test_expert_parallel_generation_equals_tp1(tmp_path):
    """--expert-model-parallel-size 2 on two ranks (runtime.start): each rank holds half of the experts (whole) and
    tokens reach them by all-to-all; Mixtral and DeepSeek-V3 generate TP 1's tokens and log-probabilities."""
    sources = [_mixtral(tmp_path), _deepseek(tmp_path)]
    one = _generate(0, 1, sources)
    two = run_ranks(2, _generate, sources, 2, tmp_dir=tmp_path)[0]
    for a, b in zip(one, two):
        for (t1, lp1), (t2, lp2) in zip(a, b):
            assert t1 == t2
            if lp1 is not None:
                assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
    assert run_ranks(2, _local_experts, sources[0], tmp_dir=tmp_path) == [[2], [2]]  # Mixtral's 4 experts, 2 a rank
