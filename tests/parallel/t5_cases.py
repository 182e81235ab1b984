"""Rank functions of the T5 tests under tests/dist.py (importable by the fork server's ranks)."""
import torch

from paratron.config import ModelConfig
from paratron.model.t5 import T5Model
from paratron.parallel.dims import initialize_model_parallel


def tiny_config(**kw) -> ModelConfig:
    base = dict(num_layers=2, decoder_num_layers=1, hidden_size=32, num_attention_heads=4, kv_channels=8,
                ffn_hidden_size=64, seq_length=16, position_embedding_type="relative",
                relative_attention_num_buckets=8, normalization="RMSNorm", geglu=True, disable_bias_linear=True,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, model="t5")
    base.update(kw)
    return ModelConfig(**base).resolved()


def batch():
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 8), generator=g)
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[1, 11:] = False
    return enc, dec, pad


def tp_logits(rank, world, sp):
    """Full logits of the tiny T5 under TP = world (gathered over the vocabulary)."""
    dims = initialize_model_parallel(tensor_model_parallel_size=world)
    model = T5Model(tiny_config(), 96, dims, sequence_parallel=sp)
    enc, dec, pad = batch()
    out = model(enc, dec, pad)
    parts = [torch.empty_like(out) for _ in range(world)]
    torch.distributed.all_gather(parts, out.contiguous(), group=dims.tp_group)
    return torch.cat(parts, -1).detach()


def replicated_grads(rank, world, sp):
    """The gradients of the parameters replicated over TP (their full tensors on every rank) after one backward of
    the loss, by name."""
    dims = initialize_model_parallel(tensor_model_parallel_size=world)
    model = T5Model(tiny_config(), 96, dims, sequence_parallel=sp)
    enc, dec, pad = batch()
    model(enc, dec, pad, labels=dec.roll(-1, 1)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None and not any(x in n for x in ("linear", "word_embeddings", "output_layer"))}
