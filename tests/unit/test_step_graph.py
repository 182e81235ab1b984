"""--cuda-graph-impl local (paratron/train/step_graph.py): the flags' checks, and the step graph's bookkeeping on the
CPU with a stand-in for the CUDA graph (capture runs the passes once over the input buffers, as the step's own
computation; each later replay runs them again over the same buffers and writes into the captured outputs). The
capture itself is checked on a GPU: tests/gpu/test_step_graph_cuda.py."""
from __future__ import annotations

import re

import pytest
import torch

from paratron.config import parse_args
from paratron.errors import ConfigError, DataError
from paratron.parallel.layout import CheckedBatch, check_batch_ids
from paratron.train.step_graph import StepGraph

GRAPH = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]


class _Replayed:
    def __init__(self, passes, inputs, outputs):
        self.passes, self.inputs, self.outputs, self.fresh = passes, inputs, outputs, True

    def replay(self):
        if self.fresh:  # the capture computed this step already
            self.fresh = False
            return
        for out, new in zip(self.outputs, self.passes(iter(self.inputs))):
            out["lm loss"].copy_(new["lm loss"])


class CPUStepGraph(StepGraph):
    def _record(self, passes):
        outputs = passes(iter(self.inputs))
        return _Replayed(passes, self.inputs, outputs), outputs


def _batch(step: int, i: int, length: int = 4) -> dict:
    return {"tokens": torch.arange(length) + 10 * step + i, "loss_mask": torch.ones(length)}


def _passes(seen: list):
    def passes(it):
        out = []
        for b in it:
            seen.append(type(b))
            out.append({"lm loss": torch.stack((b["tokens"].float().sum(), b["loss_mask"].sum()))})
        return out
    return passes


def _run(g: StepGraph, step: int, n: int = 2, seen=None, scale=1.0, length: int = 4):
    seen = [] if seen is None else seen
    return g.run(_passes(seen), iter([_batch(step, i, length) for i in range(n)]), n, scale)


def test_eager_steps_then_replays_of_each_steps_batches():
    seen, lines = [], []
    g = CPUStepGraph(2, torch.device("cpu"), log=lines.append)
    reports = [_run(g, s, seen=seen) for s in range(6)]
    assert seen[:4] == [dict] * 4 and CheckedBatch in seen[4:]  # two eager steps, then the captured buffers
    assert g.captures == 1 and len(lines) == 1 and "captured" in lines[0]
    for s, r in enumerate(reports):  # each step's own micro-batches, replayed too (refilled buffers)
        for i in range(2):
            assert r[i]["lm loss"].tolist() == [float((torch.arange(4) + 10 * s + i).sum()), 4.0]


def test_reports_are_copies_of_the_graphs_outputs():
    g = CPUStepGraph(1, torch.device("cpu"))
    _run(g, 0)
    first = _run(g, 1)
    _run(g, 2)
    assert first[0]["lm loss"][0].item() == float((torch.arange(4) + 10).sum())


@pytest.mark.parametrize("change", ["microbatches", "scale", "shape"])
def test_a_changed_step_runs_eagerly_then_is_captured_again(change):
    lines = []
    g = CPUStepGraph(2, torch.device("cpu"), log=lines.append)
    for s in range(4):
        _run(g, s)
    assert g.captures == 1
    kw = {"microbatches": {"n": 3}, "scale": {"scale": 0.5}, "shape": {"length": 6}}[change]
    seen = []
    for s in range(4, 8):
        r = _run(g, s, seen=seen, **kw)
    n = kw.get("n", 2)
    assert seen[:2 * n] == [dict] * (2 * n) and g.captures == 2 and "dropped" in lines[1]
    assert len(r) == n and r[0]["lm loss"][1].item() == kw.get("length", 4)


def test_host_state_set_back_after_each_replay():
    kept, live = [], {"unwritten": None}

    def get():
        return {"no grad"}

    def put(state):
        kept.append(state)
        live["unwritten"] = state
    g = CPUStepGraph(1, torch.device("cpu"), state=(get, put))
    for s in range(4):
        _run(g, s)
    assert kept == [{"no grad"}] * 3 and live["unwritten"] == {"no grad"}


def test_replayed_steps_check_the_loaders_token_ids():
    def check(b):
        check_batch_ids(b, 12, ("tokens",))
    g = CPUStepGraph(1, torch.device("cpu"), check=check)
    _run(g, 0)  # (the eager step's forward checks its own batches)
    with pytest.raises(DataError, match="outside the vocabulary"):
        _run(g, 1)


def test_a_failed_capture_is_one_line():
    class Failing(StepGraph):
        def _record(self, passes):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    g = Failing(1, torch.device("cpu"))
    _run(g, 0)
    with pytest.raises(ConfigError, match="could not be captured as a CUDA graph \\(CUDA error: operation not "
                                          "permitted when stream is capturing\\): ") as e:
        _run(g, 1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, problem", [
    (["--cuda-graph-impl", "local"], "add --cuda-graph-scope full_iteration"),
    (["--cuda-graph-scope", "full_iteration"], "no effect without --cuda-graph-impl local"),
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp"], "per-module graphs"),
    (["--cuda-graph-impl", "transformer_engine"], "does not use Transformer Engine"),
    (GRAPH + ["--cuda-graph-warmup-steps", "0"], "--cuda-graph-warmup-steps must be >= 1"),
    (GRAPH + ["--device", "cpu"], "need a GPU"),
    (GRAPH + ["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
    (GRAPH + ["--overlap-grad-reduce", "--use-distributed-optimizer"], "--overlap-grad-reduce"),
    (GRAPH + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], "ZeRO-2/3"),
    (["--enable-cuda-graph"], "per-layer CUDA graphs are not built"),
    (GRAPH + ["--num-experts", "4", "--moe-ffn-hidden-size", "64"], "--num-experts without --moe-grouped-gemm"),
    (GRAPH + ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-grouped-gemm",
              "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor"),
])
def test_refused_with_the_reason(flags, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", *flags], world_size=2)


def test_accepted_and_recorded():
    for moe in (["--moe-grouped-gemm"], ["--moe-grouped-gemm", "--moe-expert-capacity-factor", "1.0",
                                         "--moe-pad-expert-input-to-capacity"]):  # (the step holds these MoE paths)
        parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", *GRAPH, "--num-experts", "4",
                    "--moe-ffn-hidden-size", "64", *moe])
    cfg = parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", *GRAPH, "--cuda-graph-warmup-steps",
                      "5"])
    assert (cfg.train.cuda_graph_impl, cfg.train.cuda_graph_scope, cfg.train.cuda_graph_warmup_steps) == \
        ("local", ["full_iteration"], 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_run_without_a_gpu_is_refused_before_it_starts():
    from paratron.train.resolve import check_device
    cfg = parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", *GRAPH])
    with pytest.raises(ConfigError, match="CUDA graphs need a GPU and none is visible here"):
        check_device(cfg)


def _bert_flags(tmp_path):
    from tests.unit.test_bert_train import TINY as BERT, bert_data  # (it puts tests/ on the path for bert_helpers)
    prefix, vocab = bert_data(tmp_path)
    return ["--model", "bert", *BERT, "--data-path", prefix, "--vocab-file", vocab, "--split", "100,0,0",
            "--global-batch-size", "8", "--train-iters", "4"]


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_trainer_steps_through_the_stand_in_graph_train_as_eager_ones(family, tmp_path):
    """The Trainer with its step graph (the CPU stand-in) over two micro-batches a step: the losses of the eager run,
    step by step (the hooks, the micro-batches' copies, BERT's forward step on the graph's input buffers)."""
    from tests.unit.test_train import TINY, losses_of
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args as train_args  # (reads the BERT vocabulary's size)
    flags = (TINY + ["--train-iters", "4", "--device", "cpu"]) if family == "gpt" else _bert_flags(tmp_path)

    def run(graphed: bool):
        t = Trainer(train_args(flags))
        if graphed:
            t.step_graph = CPUStepGraph.of_run(1, t.device, t.models, t.layout, family, lambda line: None)
        return losses_of(t, 4), t
    eager, _ = run(False)
    graphed, t = run(True)
    assert t.step_graph.captures == 1 and t.num_microbatches == 2
    assert graphed == eager, (graphed, eager)
