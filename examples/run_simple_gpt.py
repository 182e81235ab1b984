"""Megatron's minimal library example with paratron's imports: a 2-layer GPT with tensor parallelism
2, trained for a few steps on mock data through get_forward_backward_func(), then saved and loaded.

    torchrun --nproc-per-node 2 examples/run_simple_gpt.py          (GPUs with NCCL, or CPUs with gloo)
"""
from __future__ import annotations

import os
import tempfile
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from paratron.checkpoint import sharded
from paratron.checkpoint.state import sharded_state_dict
from paratron.config import TransformerConfig
from paratron.data.gpt_dataset import GPTDataConfig, MockGPTDataset, MockIndexedData
from paratron.model.gpt import GPTModel
from paratron.parallel.dims import initialize_model_parallel, shutdown_distributed
from paratron.parallel.pipeline import get_forward_backward_func
from paratron.parallel.random import set_seed

VOCAB, SEQ = 100, 64


def initialize_distributed(tensor_model_parallel_size: int = 2):
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                     pipeline_model_parallel_size=1), device


def model_provider(dims, device) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, seq_length=SEQ).resolved()
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, dims=dims, device=device)


def get_train_data_iterator(batch_size: int = 8):
    cfg = GPTDataConfig(seq_length=SEQ, seed=0, eod=0)
    indexed = MockIndexedData(VOCAB, eod=0)
    dataset = MockGPTDataset(indexed, None, np.arange(len(indexed), dtype=np.int32), 1000, "train", cfg)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    return iter(loader)


def forward_step_func(device, data_iterator, model):
    def loss_func(loss_mask, output):
        total = (output * loss_mask).sum()
        n = loss_mask.sum()
        return total, n, {"lm loss": torch.stack([total.detach(), n])}

    batch = next(data_iterator)
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    output = model(tokens, labels=labels)
    return output, partial(loss_func, batch["loss_mask"].to(device))


def main():
    dims, device = initialize_distributed(tensor_model_parallel_size=2)
    set_seed(123)
    model = model_provider(dims, device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func(dims)
    for step in range(5):
        optim.zero_grad()
        reports = forward_backward_func(forward_step_func=partial(forward_step_func, device),
                                        data_iterator=train_iterator, model=model, num_microbatches=1,
                                        seq_length=SEQ, micro_batch_size=8, forward_only=False)
        optim.step()
        loss = reports[0]["lm loss"]
        if dims.rank == 0:
            print(f"step {step}: lm loss {(loss[0] / loss[1]).item():.4f}", flush=True)

    # Each rank saves its shards of the global tensors; a fresh model loads them (any layout could).
    root = tempfile.mkdtemp() if dims.rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    path = sharded.save(holder[0], 5, sharded_state_dict(model), {"example": True})
    fresh = model_provider(dims, device)
    sharded.load(sharded.find_checkpoint(holder[0]), sharded_state_dict(fresh))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    if dims.rank == 0:
        print(f"checkpoint saved to {path} and reloaded: {'identical' if same else 'DIFFERENT'}", flush=True)
    shutdown_distributed()  # the ranks leave together (a rank leaving early can abort a peer)


if __name__ == "__main__":
    main()
