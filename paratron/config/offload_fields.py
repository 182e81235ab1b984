"""The activation-offloading fields of the train section (``TrainConfig`` inherits them: --offload-modules is
``cfg.train.offload_modules``; checked in config/check_offload.py, implemented in paratron/model/activation_offload.py).
Megatron's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class OffloadFields:
    fine_grained_activation_offloading: bool = False  # what --offload-modules' modules save for backward: on the host
    offload_modules: Optional[list] = None  # attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act
    min_offloaded_tensor_size: int = 1048576  # activation offloading: smaller saved tensors stay on the device
    activation_offload_fraction: float = 1.0  # activation offloading: the first share of (layer, module) groups
    delta_offload_bytes_across_pp_ranks: int = 0  # activation offloading: less on later stages (refused: not built)
    delay_offload_until_cuda_graph: bool = False  # offloading deferred to CUDA graphs (refused)
