"""The host's side of a step: the time the Python process takes to issue a micro-batch's operations, and the
offloaded optimizer's step on the host.

An eager step issues every operation of every layer from Python (module calls, autograd, the dispatcher, the
launch): where that takes longer than the GPU runs them, the GPU waits and the step is host-bound (small
micro-batches, MoE's loop over experts, FP8's many small casts). The operations are counted, not assumed: one
layer's forward and backward (and the embedding and loss head's) run once on the CPU, at tiny widths and the
same structure (norms, activation, experts, FP8 recipe), under a dispatch mode that counts the aten operations
(``paratron/train/host_ops.py``: the planner builds no model; its callers pass the counts in). The CPU runs the plain torch paths: the fused GPU kernels (quack, FlashAttention-4) replace
several of those operations by one, which the per-operation cost, calibrated on a run that takes them, absorbs.
A compiled layer (--torch-compile) issues its kernels from Inductor's generated code, at a cost per layer and
micro-batch (forward + backward) that no CPU count gives: ``HOST_COMPILED_LAYER_MS``, measured, one figure for every
layer kind. A step replayed as one CUDA graph (--cuda-graph-impl local) is one call: no host time.

The offloaded optimizer (--optimizer-cpu-offload) runs after the backward, in series with it: Adam over the
offloaded share of the fp32 masters and moments in host memory (bytes read and written at ``host_adam_gbps``)
and the gradients' and the updated weights' copies over PCIe (``Cluster.host_gbps``).

Constants (docs/plan.md says on which measured row each was calibrated): ``HOST_OP_US`` the host cost of one
eager aten operation, forward or backward, on the H100 / H200 / A100 hosts (one constant for all three);
``HOST_ADAM_GBPS`` the host's Adam throughput in bytes moved per second; ``HOST_COMPILED_LAYER_MS`` the host's issue
time of one compiled layer's forward + backward."""
from __future__ import annotations

HOST_OP_US = {"h100": 28.5, "h200": 28.5, "a100": 28.5, "a100-40gb": 28.5}  # calibrated: llama-1b mb1 (docs/plan.md)
HOST_COMPILED_LAYER_MS = 5.54  # calibrated: llama-1b mb1 --torch-compile on an H100 (docs/plan.md)
HOST_ADAM_GBPS = 67.8  # calibrated: llama-1b distopt + offload 1.0, fused CPU AdamW (docs/plan.md)
ADAM_BYTES = 28  # per offloaded parameter: read master, grad, m, v (fp32), write master, m, v
