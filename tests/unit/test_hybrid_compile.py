"""Hybrid layers under --torch-compile: the Mamba-2 and Gated DeltaNet mixers trace as one graph each (forward
and backward, packed-document resets included) with the scans' recomputation (--kernel-linear-scan-recompute)
inside it, and a tiny hybrid model compiled as --torch-compile does trains with eager's losses; the scans'
recomputation nested in the layers' (--recompute-granularity full) keeps the gradients."""
import dataclasses

import pytest
import torch

from paratron.model.context import ForwardContext, Parallel
from paratron.model.gated_delta_net import GatedDeltaNet
from paratron.model.gpt import GPTModel
from paratron.model.mamba import MambaMixer
from paratron.model.recompute import saved_storage_bytes
from paratron.train.step import compile_layers

from .test_hybrid_model import batch, hybrid

DOCS = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])  # a document starts mid-chunk in the first row


def par(recompute: str) -> Parallel:
    return Parallel(kernels=dataclasses.replace(Parallel().kernels, kernel_linear_scan_recompute=recompute))


def step(fn, x):
    """(output, input gradient, bytes of the distinct storages autograd saved) of one forward and backward."""
    x = x.clone().requires_grad_(True)
    total, y = saved_storage_bytes(lambda: fn(x))
    y.square().sum().backward()
    return y.detach(), x.grad, total


@pytest.mark.parametrize("mixer", [MambaMixer, GatedDeltaNet])
def test_mixer_compiles_as_one_graph_and_recomputes_inside_it(mixer):
    """fullgraph=True: no graph break in the mixer (convolution, scan, resets, norm). AOTAutograd's forward and
    backward (run by aot_eager) give eager's values and gradients, and with recomputation the compiled graph
    saves less for backward than without (the checkpoint is traced, not dropped)."""
    cfg = hybrid(hybrid_layer_pattern="MG", mamba_chunk_size=4)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    saved = {}
    for recompute in ("off", "on"):
        torch.manual_seed(0)
        layer = mixer(cfg, par(recompute))
        fn = lambda t: layer(t, ForwardContext(document_ids=DOCS))  # noqa: E731
        want = step(fn, x)
        got = step(torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False), x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        saved[recompute] = got[2]
    assert saved["on"] < 0.8 * saved["off"], saved


@pytest.mark.slow
def test_compiled_hybrid_model_trains_with_eager_losses():
    """Every decoder layer compiled with Inductor as --torch-compile does (train/step.compile_layers): three
    AdamW steps on one batch (as packed documents in the second) give the eager model's losses, without a graph
    break."""
    from torch._dynamo.utils import counters
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPTModel(hybrid(hybrid_layer_pattern="MG*-", mamba_chunk_size=4), 64)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_layers(model, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        ids, labels = batch()
        for i in range(3):
            loss = model(ids, labels=labels, document_ids=DOCS if i == 1 else None).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append(losses)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0)
    assert runs[0][2] < runs[0][0]  # the steps train (the same batch, both without documents)


@pytest.mark.parametrize("granularity", [None, "full"])
def test_scan_recompute_keeps_the_model_gradients(granularity):
    """A tiny hybrid model's gradients (packed documents) with the scans recomputed equal those without, alone
    and nested in whole-layer recomputation (the scans then run a third time in the backward)."""
    from paratron.config.kernels import KernelConfig
    grads = []
    for recompute in ("off", "on"):
        torch.manual_seed(0)
        kw = dict(recompute_granularity=granularity, recompute_method="uniform", recompute_num_layers=1)
        model = GPTModel(hybrid(hybrid_layer_pattern="MG*-", mamba_chunk_size=4), 64,
                         kernels=dataclasses.replace(KernelConfig(), kernel_linear_scan_recompute=recompute),
                         **(kw if granularity else {}))
        ids, labels = batch()
        model(ids, labels=labels, document_ids=DOCS).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(g.abs().sum() > 0 for g in grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
