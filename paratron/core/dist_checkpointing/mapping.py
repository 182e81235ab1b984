"""Megatron Core's ``ShardedTensor``: one local tensor with the name and place of the global tensor it
is part of (paratron's checkpoint pieces are cut from it, paratron/checkpoint/pieces.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...checkpoint.pieces import Piece, tensor_pieces
from ...parallel.sharding import REPLICATED, ShardSpec


@dataclass
class ShardedTensor:
    key: str  # the global tensor's name in the checkpoint (layout-independent)
    data: torch.Tensor  # this rank's part of it
    spec: ShardSpec = REPLICATED  # how the global tensor is split over the ranks
    coords: dict = field(default_factory=dict)  # {group: (rank, size)} of this rank in the split groups

    @property
    def local_shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def global_shape(self) -> tuple:
        return tuple(self.spec.global_shape(self.local_shape))

    def pieces(self, into: Optional[torch.Tensor] = None) -> list[Piece]:
        """The checkpoint pieces of ``data`` (or of ``into``, a tensor of the same shape to load into)."""
        return tensor_pieces(self.key, self.data if into is None else into, self.spec, self.coords)
