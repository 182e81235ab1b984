"""Megatron Core's simple train loop (examples/run_simple_mcore_train_loop.py in NVIDIA/Megatron-LM) with
its imports changed to ``paratron.core``. Two more changes let it run without a GPU and compare layouts:
gloo and the CPU when there is no CUDA, and no dropout (so tensor parallelism gives the one-process loss).
Its loop steps torch's Adam, as Megatron's does; docs/library.md shows get_megatron_optimizer too.

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py          (TP 2)
    torchrun --nproc-per-node 1 examples/run_simple_mcore_train_loop.py --tp 1   (the one-process run)
"""
import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import torch
from torch.optim import Adam
from torch.utils.data import DataLoader

from paratron.core import dist_checkpointing, parallel_state
from paratron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from paratron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from paratron.core.datasets.utils import compile_helpers
from paratron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from paratron.core.distributed.finalize_model_grads import finalize_model_grads
from paratron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from paratron.core.models.gpt.gpt_model import GPTModel
from paratron.core.pipeline_parallel.schedules import get_forward_backward_func
from paratron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from paratron.core.tokenizers import MegatronTokenizer
from paratron.core.transformer.transformer_config import TransformerConfig

_SEQUENCE_LENGTH: int = 64
CUDA = torch.cuda.is_available()


def initialize_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """torch.distributed, then the model-parallel layout."""
    parallel_state.destroy_model_parallel()
    rank: int = int(os.environ["RANK"])
    world_size: int = int(os.environ["WORLD_SIZE"])
    local_rank: int = int(os.environ["LOCAL_RANK"])
    if CUDA:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group(backend="nccl" if CUDA else "gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider() -> GPTModel:
    """A 2-layer GPT."""
    transformer_config: TransformerConfig = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=transformer_config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
                    max_sequence_length=_SEQUENCE_LENGTH)


def get_train_data_iterator() -> Iterator:
    """Mock data through the dataset builder, in a DataLoader."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            compile_helpers()
        torch.distributed.barrier()
    else:
        compile_helpers()
    config: GPTDatasetConfig = GPTDatasetConfig(
        random_seed=0, sequence_length=_SEQUENCE_LENGTH, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"},
                                                    vocab_size=_SEQUENCE_LENGTH),
        mid_level_dataset_surplus=0.005)
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    train_dataloader: DataLoader = DataLoader(datasets[0], batch_size=8, shuffle=True)
    return iter(train_dataloader)


def forward_step_func(data_iterator: Iterator, model: torch.nn.Module) -> Tuple[torch.Tensor, Callable]:
    """One micro-batch: the per-token losses and the function that averages them over the loss mask."""

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses: torch.Tensor = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss: torch.Tensor = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss}

    data: Dict[str, torch.Tensor] = next(data_iterator)
    tokens: torch.Tensor = data["tokens"].to(device)
    attention_mask: torch.Tensor = data["attention_mask"].to(device)
    position_ids: torch.Tensor = data["position_ids"].to(device)
    labels: torch.Tensor = data["labels"].to(device)
    loss_mask: torch.Tensor = data["loss_mask"].to(device)
    output_tensor: torch.Tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path: str, gpt_model: torch.nn.Module) -> None:
    model: torch.nn.Module = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    sharded_state_dict: Dict = model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path: str, gpt_model: torch.nn.Module) -> torch.nn.Module:
    model: torch.nn.Module = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    sharded_state_dict: Dict = model.sharded_state_dict(prefix="")
    checkpoint: Dict = dist_checkpointing.load(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)
    model.load_state_dict(checkpoint)
    return gpt_model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    torch.set_printoptions(precision=6)
    initialize_distributed(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)

    gpt_model: GPTModel = model_provider()
    device: torch.device = torch.device("cuda") if CUDA else torch.device("cpu")
    gpt_model.to(device)

    config: TransformerConfig = gpt_model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt_model)
    optim: Adam = Adam(gpt_model.parameters())
    train_iterator: Iterator = get_train_data_iterator()
    forward_backward_func: Callable[..., Dict[str, Any]] = get_forward_backward_func()

    for iteration in range(5):
        optim.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=train_iterator, model=gpt_model, num_microbatches=1,
            seq_length=_SEQUENCE_LENGTH, micro_batch_size=8, decoder_seq_length=_SEQUENCE_LENGTH, forward_only=False)
        finalize_model_grads([gpt_model])
        optim.step()
        print(f"Iteration {iteration}: Losses reduced: {losses_reduced}", flush=True)

    ckpt_path: str = os.getcwd() + "/ckpt"
    Path(ckpt_path).mkdir(exist_ok=True)
    save_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)

    saved = {k: v.clone() for k, v in gpt_model.module.state_dict().items()}
    with torch.no_grad():  # (not in Megatron's loop) forget the weights, so that loading has to bring them back
        for p in gpt_model.parameters():
            p.zero_()
    gpt_model = load_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    gpt_model.to(device)
    same = all(torch.equal(saved[k], v) for k, v in gpt_model.module.state_dict().items())
    print(f"Successfully loaded the model ({'identical' if same else 'DIFFERENT'} weights)", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
