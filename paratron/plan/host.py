"""The host's side of a step: the time the Python process takes to issue a micro-batch's operations, and the
offloaded optimizer's step on the host.

An eager step issues every operation of every layer from Python (module calls, autograd, the dispatcher, the
launch): where that takes longer than the GPU runs them, the GPU waits and the step is host-bound (small
micro-batches, MoE's loop over experts, FP8's many small casts). The operations are counted, not assumed: one
layer's forward and backward (and the embedding and loss head's) run once on the CPU, at tiny widths and the
same structure (norms, activation, experts, FP8 recipe), under a dispatch mode that counts the aten operations
(``count_ops``). The CPU runs the plain torch paths: the fused GPU kernels (quack, FlashAttention-4) replace
several of those operations by one, which the per-operation cost, calibrated on a run that takes them, absorbs.
A compiled layer (--torch-compile) issues its kernels from Inductor's generated code: its host time is taken as
hidden behind the GPU (not counted).

The offloaded optimizer (--optimizer-cpu-offload) runs after the backward, in series with it: Adam over the
offloaded share of the fp32 masters and moments in host memory (bytes read and written at ``host_adam_gbps``)
and the gradients' and the updated weights' copies over PCIe (``Cluster.host_gbps``).

Constants (docs/plan.md says on which measured row each was calibrated): ``HOST_OP_US`` the host cost of one
eager aten operation, forward or backward, on the H100 / H200 / A100 hosts (one constant for all three);
``HOST_ADAM_GBPS`` the host's Adam throughput in bytes moved per second."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import Config

HOST_OP_US = {"h100": 28.5, "h200": 28.5, "a100": 28.5, "a100-40gb": 28.5}  # calibrated: llama-1b mb1 (docs/plan.md)
HOST_ADAM_GBPS = 23.1  # calibrated: llama-1b distopt + offload 1.0 (docs/plan.md)
ADAM_BYTES = 28  # per offloaded parameter: read master, grad, m, v (fp32), write master, m, v


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched (views and metadata included: each is a host call)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def tiny_copy(cfg: Config, layers: int) -> Config:
    """``cfg``'s model at tiny widths with ``layers`` layers, on one rank, eager: the same operations per layer."""
    from ..config import finalize
    c = cfg.unfrozen()
    m = c.model
    groups = max(1, m.num_attention_heads // max(1, m.num_query_groups or m.num_attention_heads))
    m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_channels = layers, 64, 4, 16
    m.num_query_groups = max(1, 4 // groups) if m.group_query_attention else None
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 128, 16, 16
    if m.num_experts:  # every layer of the MoE kind (a pattern of the model's layers does not fit one or two)
        m.moe_ffn_hidden_size, m.moe_layer_freq = 32, 1
        m.moe_shared_expert_intermediate_size = 32 if m.moe_shared_expert_intermediate_size else None
    m.mtp_num_layers = None
    c.train.micro_batch_size, c.train.global_batch_size, c.train.torch_compile = 1, 1, False
    c.train.recompute_granularity = None
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        c.set(name, 1)
    c.set("virtual_pipeline_model_parallel_size", None)
    c.set("expert_tensor_parallel_size", None)
    c.data.mock_data, c.data.vocab_size, m.make_vocab_size_divisible_by = True, 512, 32
    return finalize(c, 1)


def count_ops(cfg: Config) -> int:
    """aten operations of one forward and backward of ``cfg``'s model (one micro-batch) on the CPU."""
    from ..train.distributed import build_dims
    from ..train.step import build_model_chunks
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    tokens = torch.randint(0, 500, (1, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))
    with OpCounter() as counter:
        model(tokens, labels=tokens).float().sum().backward()
    return counter.count


_COUNTED: dict = {}  # (the tiny copy's model and train sections) -> counts: the search asks many times


def ops_per_layer(cfg: Config) -> tuple[int, int]:
    """(operations of one layer's forward + backward, of the rest: embedding, final norm, loss head), counted on
    tiny copies of one and two layers. MoE models count the layer of their first MoE kind."""
    one = tiny_copy(cfg, 1)
    key = repr((one.model, one.train, one.kernels))
    if key not in _COUNTED:
        n1, n2 = count_ops(one), count_ops(tiny_copy(cfg, 2))
        _COUNTED[key] = (n2 - n1, 2 * n1 - n2)
    return _COUNTED[key]
