"""MoE layers under --torch-compile (issue 46): at EP 1 with dropless grouped-GEMM routing the MoE layer is traced
with its transformer layer as one graph (no break at the router's running sums, the recomputation flag or the aux
losses' scale), compiles once for a whole run (the sums and the scale are device tensors: nothing recompiles when
they change), and trains with eager's losses, aux-loss and z-loss metrics and expert-bias counts, with and without
full recomputation (a recomputed router does not count twice). The paths that read the device on the host (token
dropping, the per-expert loop) stay eager islands inside the compiled layer."""
import dataclasses

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from paratron.config import ModelConfig
from paratron.model import moe
from paratron.model.gpt import GPTModel
from paratron.model.layers import Parallel
from paratron.train.step import compile_layers

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")

MICRO_BATCHES, BATCH, SEQ = 2, 2, 16


def tiny(**kw) -> ModelConfig:
    """Two MoE layers with every router feature that keeps running state: aux loss, z-loss, expert bias, a
    shared expert; bf16 (torch._grouped_mm's compiled form takes bf16 only)."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=SEQ, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=16, hidden_dropout=0.0, attention_dropout=0.0,
                moe_router_dtype="fp32", swiglu=True, moe_grouped_gemm=True, moe_aux_loss_coeff=1e-2,
                moe_z_loss_coeff=1e-3, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                moe_shared_expert_intermediate_size=16)
    return ModelConfig(**{**base, **kw}).resolved()


class CountingBackend:
    """aot_eager (AOTAutograd's forward and backward, run by eager torch), counting the graphs dynamo hands it:
    one per compilation, so a recompilation or a graph break adds one."""

    def __init__(self):
        self.graphs = 0
        self.inner = lookup_backend("aot_eager")

    def __call__(self, gm, inputs):
        self.graphs += 1
        return self.inner(gm, inputs)


def train(model: GPTModel, steps: int) -> list[dict]:
    """AdamW steps of two micro-batches each, as the training loop drives the routers (the aux losses' scale
    changes every step, as a dynamic loss scale does); per step the losses, the logged MoE metrics, the routers'
    counts before the step and the expert biases after it."""
    routers = moe.routers([model])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        moe.before_step(routers, 2.0 ** (i % 3), MICRO_BATCHES, False)
        opt.zero_grad()
        losses = []
        for _ in range(MICRO_BATCHES):
            tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        counts = [(r.metric_sums[:, 1].tolist(), r.tokens_per_expert.sum().item()) for r in routers]
        moe.after_step(routers)
        means, _ = moe.take_metrics(routers, "cpu", False, model.config.num_layers)
        out.append(dict(losses=losses, metrics=means, counts=counts, bias=[r.expert_bias.clone() for r in routers]))
    return out


def run(compiled: bool, steps: int, recompute=None, **kw):
    """(per-step records, the graphs compiled after the first step, after the last)."""
    torch.manual_seed(0)
    model = GPTModel(tiny(**kw), 64, recompute_granularity=recompute, dtype=torch.bfloat16)
    backend = CountingBackend()
    if compiled:  # as compile_layers does, with fullgraph: any graph break in a layer raises
        torch._dynamo.reset()
        counters.clear()
        for layer in model.decoder.layers:
            layer.compile(backend=backend, fullgraph=True, dynamic=False)
    first = train(model, 1)
    after_first = backend.graphs
    return first + train(model, steps - 1), after_first, backend.graphs


def assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g["losses"], w["losses"], rtol=1e-5, atol=0)
        assert g["metrics"].keys() == w["metrics"].keys() == {"load_balancing_loss", "z_loss"}
        torch.testing.assert_close(g["metrics"], w["metrics"], rtol=1e-5, atol=0)
        assert g["counts"] == w["counts"]
        torch.testing.assert_close(g["bias"], w["bias"], rtol=0, atol=0)


def test_moe_layer_compiles_whole_once_and_trains_as_eager():
    """fullgraph=True over each transformer layer (attention and the MoE layer: router with its running sums,
    dropless grouped expert path, shared expert): no graph break; one graph for the run (the layers share it, the
    changing aux-loss scale and metric sums recompile nothing over 12 steps); eager's losses and metrics."""
    want, _, _ = run(False, 12)
    got, after_first, after_last = run(True, 12)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert after_first == after_last == 1, (after_first, after_last)
    assert_same(got, want)
    tokens = MICRO_BATCHES * BATCH * SEQ
    assert want[0]["counts"][0] == ([MICRO_BATCHES, 0.0, MICRO_BATCHES], float(tokens * 2))


def test_compiled_full_recomputation_counts_the_router_once():
    """--recompute-granularity full: each compiled layer runs again inside backward; the recomputed router adds
    nothing to the metric sums and the expert-bias counts (recompute.counted, read at run time in the graph)."""
    want, _, _ = run(False, 3)
    got, _, after_last = run(True, 3, recompute="full")
    assert not counters["graph_break"] and after_last == 1
    assert_same(got, want)


def test_host_reading_paths_stay_eager_islands():
    """Token dropping without padding (``nonzero``) and the per-expert loop (the counts on the host) leave the
    compiled layer for their expert path only: a graph break there, nowhere else, and eager's numbers."""
    for kw in (dict(moe_expert_capacity_factor=1.0), dict(moe_grouped_gemm=False)):
        torch.manual_seed(2)
        layer = moe.MoELayer(tiny(**kw), Parallel(), dtype=torch.bfloat16)
        x = torch.randn(8, 2, 32, dtype=torch.bfloat16)
        want = layer(x)
        explained = torch._dynamo.explain(layer)(x)
        assert explained.graph_break_count == 1, explained.break_reasons
        reason = explained.break_reasons[0]
        assert "_eager_local" in reason.reason and reason.user_stack[-1].name == "_routed", reason
        got = torch.compile(layer, backend="aot_eager")(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_kernel_moe_compile_experts_keeps_the_layer_eager():
    """--kernel-moe-compile experts (the earlier regional form): the layer is an eager island, its dropless grouped
    expert path compiled on its own; compile_layers's default traces the MoE layers with their layer."""
    for choice, whole in (("layer", True), ("experts", False)):
        model = GPTModel(tiny(num_layers=1), 64, dtype=torch.bfloat16)
        compile_layers(model, torch.device("cpu"), "off", choice)
        layer = model.decoder.layers[0].mlp
        assert layer.compile_whole is whole and (layer.local is moe.local_experts) is whole


def test_aux_loss_scale_is_a_device_buffer():
    """The aux losses' backward scale: written in place (a compiled layer reads it at run time), and the
    router's losses get the gradient it says."""
    torch.manual_seed(4)
    cfg = dataclasses.replace(tiny(), moe_z_loss_coeff=None, moe_router_enable_expert_bias=False)
    router = moe.Router(cfg)
    buffer = router.aux_loss_scale
    grads = []
    for scale in (1.0, torch.tensor(3.0)):
        moe.set_aux_loss_scale([router], scale)
        router.weight.grad = None
        probs, _ = router(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)), SEQ)
        (probs * 0).sum().backward()  # only the aux loss reaches the router's weight
        grads.append(router.weight.grad.clone())
    assert router.aux_loss_scale is buffer and buffer.item() == 3.0
    torch.testing.assert_close(grads[1], grads[0] * 3)


@pytest.mark.slow
def test_torch_compile_trains_a_bf16_moe_model_without_graph_breaks():
    """The real path (Trainer, --torch-compile: compile_layers with Inductor): no graph break, one graph for both
    layers over three steps, and the eager run's losses to bf16 precision (Inductor computes bf16 elementwise
    chains in fp32, so the numbers are close, not equal; aot_eager's are equal, above). About 45 s on 2 CPU cores."""
    pytest.importorskip("torch._inductor")
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    from .test_moe import TINY
    runs = []
    for flags in ([], ["--torch-compile"]):
        torch._dynamo.reset()
        counters.clear()
        t = Trainer(parse_args(TINY + ["--train-iters", "3", "--bf16", "--moe-grouped-gemm",
                                       "--moe-shared-expert-intermediate-size", "16", *flags]))
        runs.append([(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(3))])
        t.close()
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    torch.testing.assert_close(runs[1], runs[0], rtol=5e-3, atol=0)
