"""Activation recomputation changes nothing, bit for bit, at TP 2 with dropout on: the recomputed
forward draws the same dropout masks (default stream and the TP-region stream) as the original one,
and the streams continue afterwards as if nothing had been recomputed."""
import pytest
import torch

from tests.dist import run_ranks
from tests.parallel.common import global_batches, micro_batches, tiny_config

STEPS = 3
RECOMPUTE = {
    "none": {},
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_activations=True),
}


def _run(cfg, steps: int) -> dict:
    """Losses, this rank's gradients after each step, and its parameters at the end."""
    from paratron.train.loop import Trainer, build_dims
    dims = build_dims(cfg)
    data = micro_batches(global_batches(cfg, steps), cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(data, None))
    model = trainer.model.module
    losses, grads = [], []
    for _ in range(steps):
        report, _, _ = trainer.train_step()
        losses.append(report[0] / report[1])
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.close()
    return {"losses": losses, "grads": grads, "params": params}


def _rank(rank, world, style, sp):
    out = {}
    for name, flags in RECOMPUTE.items():
        cfg = tiny_config(style, tensor_model_parallel_size=world, sequence_parallel=sp, hidden_dropout=0.1,
                          attention_dropout=0.1, global_batch_size=4, **flags)
        assert cfg.model.hidden_dropout == 0.1 and cfg.model.attention_dropout == 0.1
        assert cfg.train.global_batch_size // cfg.train.micro_batch_size == 2  # two micro-batches a step
        out[name] = _run(cfg, STEPS)
    return out


@pytest.mark.parametrize("style,sp", [("gpt", False), ("llama", True)])
def test_recompute_is_bit_exact_at_tp2_with_dropout(tmp_path, style, sp):
    for runs in run_ranks(2, _rank, style, sp, tmp_dir=tmp_path):
        ref = runs.pop("none")
        for name, got in runs.items():
            for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
                assert torch.equal(a, b), f"{name}, step {step}: loss {b.item()} vs {a.item()} without recompute"
            for step, (ga, gb) in enumerate(zip(ref["grads"], got["grads"])):
                for n in ga:
                    assert torch.equal(ga[n], gb[n]), f"{name}, step {step}: gradient of {n} differs"
            for n in ref["params"]:
                assert torch.equal(ref["params"][n], got["params"][n]), f"{name}: parameter {n} differs"
