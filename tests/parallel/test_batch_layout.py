"""What the BatchLayout drives across ranks, on CPU/gloo:

- --calculate-per-token-loss: every loss token weighs the same however the loss masks spread over
  micro-batches and ranks. With uneven masks (data-parallel rank 1's samples mostly masked) DP 2 and
  PP 2 equal one rank running the whole global batch as a single micro-batch (where both of
  Megatron's normalisations coincide); without the flag DP 2 does not (the per-micro-batch mean
  weighs the sparse micro-batches up), so the comparison can fail;
- a stage's sent activations are freed (deallocate_output_tensor): when their backward starts, their
  storage no longer exists (GPT-style output, and Llama-style whose output is a view);
- several tensors of different shapes and dtypes travel between stages (1F1B and interleaved),
  gradients flowing back for the floating-point ones, and equal a one-process computation;
- stages with different transfer specs fail with a clear error before any transfer.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from paratron.parallel.layout import BatchLayout
from paratron.parallel.p2p import TensorSpec
from tests.dist import run_ranks
from tests.parallel.common import assert_close_runs, global_batches, micro_batches, tiny_config

STEPS = 3
PER_TOKEN = {"calculate_per_token_loss": True}


def uneven_samples(cfg, steps: int) -> list[dict]:
    """The usual test batches, with samples 2, 3, 6, 7 of each global batch of 8 (data-parallel rank
    1's at micro-batch 2 x DP 2) keeping only about 10 % of their loss tokens."""
    samples = global_batches(cfg, steps)
    g = torch.Generator().manual_seed(3)
    for i, s in enumerate(samples):
        if (i % 8) // 2 % 2 == 1:
            s["loss_mask"] = s["loss_mask"] * (torch.rand(s["loss_mask"].shape, generator=g) < 0.1).float()
    return samples


def record_frees(trainer, log: list) -> None:
    """Wrap the trainer's forward step: for each output a non-last stage sends (hidden states, 3-d),
    log at the start of its backward whether its storage has been freed."""
    inner = trainer.forward_step

    def forward_step(data_iterator, model):
        out, loss_func = inner(data_iterator, model)
        if torch.is_grad_enabled() and out.dim() == 3:
            handle = out.untyped_storage()._weak_ref()
            out.register_hook(lambda g: log.append(torch.UntypedStorage._expired(handle)))
        return out, loss_func
    trainer.forward_step = forward_step


def train(style: str, steps: int = STEPS, **settings) -> dict:
    from paratron.parallel.stages import global_named_parameters
    from paratron.train.loop import Trainer, build_dims
    cfg = tiny_config(style, **settings)
    dims = build_dims(cfg)
    data = micro_batches(uneven_samples(cfg, steps), cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(data, None))
    frees: list = []
    if dims.pp > 1:
        record_frees(trainer, frees)
    losses, norms = [], []
    for _ in range(steps):
        report, _, norm = trainer.train_step()
        losses.append((report[0] / report[1].clamp(min=1)).item())
        norms.append(float(norm))
    params = {n: p.detach().clone() for n, p in global_named_parameters(trainer.models).items()}
    trainer.close()
    return {"losses": losses, "norms": norms, "params": params, "last_stage": dims.is_last_stage, "frees": frees}


def assert_same(ref: dict, got: dict, rtol: float = 1e-5) -> None:
    """Losses and parameters (common.assert_close_runs), and the gradient norms: Adam hardly sees a
    gradient off by a constant factor (say DP), the norm does."""
    assert_close_runs(ref, got, rtol)
    assert got["norms"] == pytest.approx(ref["norms"], rel=rtol)


def merged(ranks: list[dict], ref: dict) -> dict:
    """One run's losses (from the last stage) and parameters (from every stage; the last stage's copy
    of a tied embedding left out)."""
    params = {}
    for r in ranks:
        params.update({n: p for n, p in r["params"].items() if n in ref["params"]})
    last = next(r for r in ranks if r["last_stage"])
    return {"losses": last["losses"], "norms": last["norms"], "params": params}


def _two_ranks(rank, world):
    out = {"dp2_per_token": train("gpt", **PER_TOKEN), "dp2_default": train("gpt"),
           "pp2_per_token": train("gpt", pipeline_model_parallel_size=2, **PER_TOKEN),
           "pp2_llama": train("llama", pipeline_model_parallel_size=2)}
    out["multi"] = {v: multi_tensor_rank(rank, world, v) for v in (1, 2)}
    out["disagree"] = disagreeing_specs(rank)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(2, _two_ranks, tmp_dir=tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def reference():
    """One rank, the whole global batch of 8 as one micro-batch: the global token mean either way."""
    return train("gpt", micro_batch_size=8, **PER_TOKEN)


def test_per_token_loss_one_rank_does_not_depend_on_micro_batches(reference):
    assert_same(reference, train("gpt", micro_batch_size=2, **PER_TOKEN))


def test_per_token_loss_dp2_equals_one_rank(two, reference):
    for r in two:
        assert_same(reference, r["dp2_per_token"])


def test_default_normalisation_dp2_differs_from_the_token_mean(two, reference):
    """Megatron's default weighs each micro-batch's mean equally: with uneven masks it is not the
    global token mean, so the per-token test above can tell the two apart."""
    got = two[0]["dp2_default"]
    assert got["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6)  # the same weights at step 0
    worst = max(((a - got["params"][n]).norm() / a.norm()).item() for n, a in reference["params"].items())
    assert worst > 1e-3, worst


def test_per_token_loss_pp2_equals_one_rank(two, reference):
    assert_same(reference, merged([r["pp2_per_token"] for r in two], reference))


@pytest.mark.parametrize("case", ["pp2_per_token", "pp2_llama"])
def test_sent_activations_are_freed_before_their_backward(two, case):
    first, last = two[0][case], two[1][case]
    assert last["frees"] == []  # the last stage sends nothing
    assert len(first["frees"]) == STEPS * 4 and all(first["frees"]), first["frees"]  # 4 micro-batches a step


# ---- several tensors per transfer ---------------------------------------------------------------------
SEQ, MBS, HIDDEN = 4, 2, 3


class ThreeTensors(BatchLayout):
    """Hidden states, a [s, b, 1] side channel and integer ids that travel without a gradient."""

    def p2p_specs(self) -> list[TensorSpec]:
        return [TensorSpec((SEQ, MBS, HIDDEN), torch.float32), TensorSpec((SEQ, MBS, 1), torch.float32),
                TensorSpec((MBS, SEQ), torch.int64)]


def stage_fn(stage: int, last: int, w, inputs, batch):
    """Virtual stage s of the chain: first from the data, last to a scalar loss sum."""
    if stage == 0:
        a = batch["x"] * w
        return [a, a.sum(-1, keepdim=True) * w, batch["ids"]]
    a, b, ids = inputs
    if stage == last:
        return a * w + b * ids.t().unsqueeze(-1).float()
    return [a * w, b * w + a.sum(-1, keepdim=True), ids]


class ChainStage(nn.Module):
    def __init__(self, stage: int, last: int):
        super().__init__()
        self.stage, self.last = stage, last
        self.w = nn.Parameter(torch.tensor(1.0 + 0.1 * stage))
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, batch):
        return stage_fn(self.stage, self.last, self.w, self.input_tensor, batch)


def chain_batches(m: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(SEQ, MBS, HIDDEN, generator=g), "ids": torch.randint(1, 4, (MBS, SEQ), generator=g)}
            for _ in range(m)]


def chain_step(data_iterator, model):
    out = model(next(data_iterator))

    def loss_func(y):
        n = torch.tensor(float(y.numel()))
        total = 0.5 * (y ** 2).sum()
        return total, n, {"lm loss": torch.stack([total.detach(), n])}
    return out, loss_func


def chain_reference(stages: int, m: int):
    """Per micro-batch loss sums and the gradients of every w, in one process."""
    ws = [torch.tensor(1.0 + 0.1 * s, requires_grad=True) for s in range(stages)]
    losses = []
    for batch in chain_batches(m):
        x = None
        for s in range(stages):
            x = stage_fn(s, stages - 1, ws[s], x, batch)
        total = 0.5 * (x ** 2).sum()
        losses.append(total.item())
        (total / x.numel() / m).backward()
    return losses, [w.grad.item() for w in ws]


def multi_tensor_rank(rank: int, world: int, vpp: int) -> dict:
    from paratron.parallel.dims import initialize_model_parallel
    from paratron.parallel.pipeline import PipelineSchedule
    dims = initialize_model_parallel(1, world, vpp if vpp > 1 else None)
    last = world * vpp - 1
    chunks = [ChainStage(c * world + rank, last) for c in range(vpp)]
    m = 4
    reports = PipelineSchedule(dims, 60.0)(forward_step_func=chain_step, data_iterator=iter(chain_batches(m)),
                                           model=chunks, num_microbatches=m, layout=ThreeTensors(MBS, SEQ, HIDDEN))
    return {"losses": [r["lm loss"][0].item() for r in reports], "grads": {c.stage: c.w.grad.item() for c in chunks}}


@pytest.mark.parametrize("vpp", [1, 2])
def test_several_tensors_travel_and_equal_one_process(two, vpp):
    stages = 2 * vpp
    losses, grads = chain_reference(stages, 4)
    assert two[0]["multi"][vpp]["losses"] == []
    assert two[1]["multi"][vpp]["losses"] == pytest.approx(losses, rel=1e-6)
    got = {s: g for r in two for s, g in r["multi"][vpp]["grads"].items()}
    assert [got[s] for s in range(stages)] == pytest.approx(grads, rel=1e-5)


def disagreeing_specs(rank: int) -> list[str]:
    """Stages that would move different tensors: an error on both, before any transfer."""
    from paratron.parallel.dims import initialize_model_parallel
    from paratron.parallel.p2p import PipelineError
    from paratron.parallel.pipeline import PipelineSchedule
    dims = initialize_model_parallel(1, 2)
    msgs = []
    layouts = [BatchLayout(MBS, SEQ * (1 + rank), HIDDEN),  # shapes
               ThreeTensors(MBS, SEQ, HIDDEN) if rank else BatchLayout(MBS, SEQ, HIDDEN),  # number of tensors
               BatchLayout(MBS, SEQ, HIDDEN, torch.bfloat16 if rank else torch.float32)]  # dtypes
    for layout in layouts:
        try:
            PipelineSchedule(dims)._comm(layout, 4)
            msgs.append("")
        except PipelineError as e:
            msgs.append(str(e))
    return msgs


def test_stages_with_different_specs_fail_clearly(two):
    for r in two:
        shapes, count, dtype = r["disagree"]
        assert "pipeline stages disagree on the layout (tensors [(4, 2, 3) torch.float32]..[(8, 2, 3) " \
               "torch.float32])" in shapes
        assert "(tensors 1..3, tensor dimensions 5..14)" in count
        assert "(tensors [(4, 2, 3) torch.float32]..[(4, 2, 3) torch.bfloat16])" in dtype
