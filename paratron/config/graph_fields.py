"""The CUDA graph fields of the train section (``TrainConfig`` inherits them: --cuda-graph-impl is
``cfg.train.cuda_graph_impl``; checked in config/check_graphs.py, implemented in paratron/train/step_graph.py).
Megatron's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class GraphFields:
    cuda_graph_impl: str = "none"  # none | local: the step's forward and backward passes replayed as one CUDA graph
    cuda_graph_scope: Optional[list] = None  # with --cuda-graph-impl local: full_iteration (the only scope built)
    cuda_graph_warmup_steps: int = 3  # eager steps before the capture (and after each re-capture)
