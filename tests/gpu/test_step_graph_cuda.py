"""--cuda-graph-impl local --cuda-graph-scope full_iteration on the GPU (paratron/train/step_graph.py; skipped without
CUDA): training steps replayed from one CUDA graph give the losses, gradient norms and weights of the same steps run
eagerly (to the run-to-run spread of the GPU's atomic additions): a dense model eager and compiled, with two micro-batches a step; an MoE model (grouped GEMM, fused
permutation) compiled; FP8 tensorwise with the weight cache inside the graph and the delayed recipe; dropout, eager and
compiled, and under full and selective recomputation (the recomputed masks are the forward's)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RUN = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
       "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--lr", "1e-3",
       "--train-iters", "8", "--bf16", "--eval-iters", "0", "--device", "cuda", "--disable-bias-linear",
       "--hidden-dropout", "0", "--attention-dropout", "0"]
GRAPH = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--cuda-graph-warmup-steps", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-grouped-gemm",
       "--moe-permute-fusion"]
CASES = {"eager": [], "compiled": ["--torch-compile"], "moe": ["--torch-compile", *MOE],
         "fp8-tensorwise": ["--torch-compile", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
         "fp8-delayed-moe": ["--torch-compile", "--fp8-format", "e4m3", "--fp8-recipe", "delayed",
                             "--fp8-amax-history-len", "4", *MOE]}
# Dropout draws from the device's default generator, which torch registers with the graph: a replay draws from the
# generator's offset as the eager step would, so the same seed gives the same masks. Recomputation draws them again
# in backward from the state the forward found (torch.utils.checkpoint's own replay of the generator).
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
CASES.update({"dropout": DROPOUT, "dropout-compiled": ["--torch-compile", *DROPOUT],
              "dropout-recompute-full": [*DROPOUT, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "1"],
              "dropout-recompute-selective": [*DROPOUT, "--recompute-activations"]})


def _run(flags):
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    t = Trainer(parse_args(RUN + flags))
    steps = [t.train_step() for _ in range(8)]
    losses = [(r[0] / r[1]).item() for r, _, _ in steps]
    norms = [float(n) for _, _, n in steps]
    weights = torch.cat([p.detach().float().flatten() for p in t.model.parameters()])
    return t, losses, norms, weights


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_steps_train_as_eager_steps(case):
    if case.startswith("fp8") and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 on Hopper")
    _, losses, norms, weights = _run(CASES[case])
    t, g_losses, g_norms, g_weights = _run(CASES[case] + GRAPH)
    assert t.step_graph.captures == 1 and t.step_graph.graph is not None
    assert g_losses == pytest.approx(losses, rel=2e-3), (g_losses, losses)  # (atomics: not bit-equal everywhere)
    assert g_norms == pytest.approx(norms, rel=2e-2), (g_norms, norms)
    assert (g_weights - weights).norm() < 1e-2 * weights.norm()
    assert g_losses[-1] < g_losses[0]


def test_the_expert_loop_is_refused_before_the_capture():
    """The expert loop without --moe-grouped-gemm reads the split sizes on the host: refused at start-up by its flag
    (a host read nothing refuses stops the capture with its reason: tests/unit/test_step_graph.py)."""
    from paratron.errors import ConfigError
    with pytest.raises(ConfigError, match="--num-experts without --moe-grouped-gemm"):
        _run(["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", *GRAPH])
