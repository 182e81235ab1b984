"""Shared by the multi-rank tests: a tiny config, deterministic batches, and a few real training
steps (paratron's Trainer.train_step) returning the losses and the full (gathered over TP, EP and expert-TP)
parameters."""
from __future__ import annotations

import torch

from paratron.config import Config, finalize
from paratron.parallel.tensor import gather_global

VOCAB = 512


def tiny_config(style: str = "gpt", world_size: int | None = None, **parallel) -> Config:
    """Resolved for ``world_size`` processes (default: this process group's); ``parallel``: any fields."""
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 8, 32
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 32  # padded vocab 512 at TP 1, 2 and 4: identical models
    if style == "llama":
        m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
        m.group_query_attention, m.num_query_groups = True, 4
        m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, True
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.train_iters = 2, 8, 3
    cfg.optim.lr, cfg.optim.lr_warmup_iters = 1e-2, 1
    # The key bias has an exactly-zero gradient (softmax ignores a shift shared by all keys), so its
    # computed gradient is rounding noise that Adam with eps 1e-8 would blow up into lr-sized
    # steps differing between layouts. eps 1e-6 leaves every real gradient's update as it is.
    cfg.optim.adam_eps = 1e-6
    cfg.data.mock_data, cfg.data.vocab_size = True, VOCAB
    cfg.log.log_interval = 1
    for k, v in parallel.items():
        cfg.set(k, v)
    return finalize(cfg, world_size)


def global_batches(cfg: Config, steps: int, seed: int = 7) -> list[dict]:
    """steps x global batch of samples, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    n, s = steps * cfg.train.global_batch_size, cfg.model.seq_length
    toks = torch.randint(0, VOCAB, (n, s + 1), generator=g)
    mask = (torch.rand(n, s, generator=g) > 0.1).float()
    return [{"tokens": toks[i, :-1], "labels": toks[i, 1:], "loss_mask": mask[i], "position_ids": torch.arange(s)}
            for i in range(n)]


def micro_batches(samples: list[dict], cfg: Config, dp_rank: int, dp: int):
    """Megatron's sampler order: each global batch in chunks of mbs x dp; rank r takes its block."""
    mbs = cfg.train.micro_batch_size
    for start in range(0, len(samples), mbs * dp):
        chunk = samples[start + dp_rank * mbs: start + (dp_rank + 1) * mbs]
        yield {k: torch.stack([x[k] for x in chunk]) for k in chunk[0]}


def run_steps(cfg: Config, steps: int, dims=None) -> dict:
    from paratron.train.loop import Trainer, build_dims
    dims = dims or build_dims(cfg)
    data = micro_batches(global_batches(cfg, steps), cfg, dims.dp_rank, dims.dp)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(data, None))
    losses = []
    for _ in range(steps):
        report, ok, _ = trainer.train_step()
        losses.append((report[0] / report[1]).item())
    model = trainer.model.module
    params = {n: gather_global(p, dims).clone() for n, p in model.named_parameters()}
    trainer.close()
    return {"losses": losses, "params": params}


def assert_close_runs(ref: dict, got: dict, rtol: float = 1e-5) -> None:
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= rtol * abs(a), f"step {i}: loss {b} vs reference {a}"
    assert ref["params"].keys() == got["params"].keys()
    for n, a in ref["params"].items():
        b = got["params"][n]
        assert a.shape == b.shape, n
        err = ((a - b).norm() / a.norm().clamp(min=1e-12)).item()
        assert err <= rtol, f"{n}: relative difference {err:.2e}"
