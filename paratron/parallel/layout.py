"""BatchLayout: how one micro-batch is laid out on this rank, shared by the data path, the model's
inputs, the loss and the pipeline schedule.

- the micro-batch (``--micro-batch-size`` b samples of ``--seq-length`` s tokens) and this rank's
  slice of its sequence (``slice_sequence``: with context parallelism Megatron's split into 2 x CP
  chunks, rank r taking chunks r and 2 CP - 1 - r so that causal attention costs the same on every
  rank, paratron/parallel/context.py); the document ids of packed sequences stay whole;
- the position ids, made here for the whole sequence before slicing: the data's own with
  ``--reset-position-ids`` (they restart after each end-of-document), else 0 .. s-1;
- the loss normalisation, Megatron's two: by default each micro-batch's loss is its mean over its
  own loss tokens, divided by the number of micro-batches, and data-parallel ranks average their
  gradients; with ``--calculate-per-token-loss`` each micro-batch backpropagates its loss *sum*,
  the data-parallel reduction sums, and ``finalize_model_grads`` divides the gradients by the
  step's global token count (every loss token then weighs the same, however the loss masks
  spread over micro-batches and ranks). Under context parallelism a micro-batch's tokens are spread
  over the CP ranks: the default divides each rank's loss sum by the token count of the whole CP
  group and multiplies by CP (the gradient average over data x context parallelism divides by it);
- what crosses a pipeline boundary: the activation ``[s/CP/(TP with sequence parallelism), b, h]``
  in the pipeline dtype (the parameters'), as the list of ``TensorSpec`` that ``P2P`` moves.

It lives in ``paratron/parallel/`` rather than ``train/``: it is a function of the parallel layout
(TP with sequence parallelism, CP) and the pipeline schedule, which is in ``parallel/`` and must
not import ``train/``, reads its transfer specs from it. ``train/`` builds it (``from_config``) and
prepares each micro-batch with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .context import split_sequence
from .dims import ParallelDims
from .p2p import TensorSpec
from .tensor import check_token_ids


def microbatch_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor, num_microbatches: int,
                    per_token: bool = False) -> torch.Tensor:
    """The loss one micro-batch backpropagates (before the loss scale): its sum with
    ``--calculate-per-token-loss`` (the gradients are divided by the global token count after the
    last backward), else its mean over its own tokens divided by the number of micro-batches."""
    if per_token:
        return loss_sum
    return loss_sum / num_tokens.clamp(min=1) / num_microbatches


ID_KEYS = {"gpt": ("tokens", "labels"), "bert": ("text",), "t5": ("text_enc", "text_dec")}  # checked token ids


class CheckedBatch(dict):
    """A micro-batch whose token ids were checked on the host already (a CUDA graph's input buffers, on the device,
    paratron/train/step_graph.py): the forward step checks it no more."""


def check_batch_ids(batch: dict, vocab_size: Optional[int], keys: tuple) -> None:
    """The one-line error of ``check_token_ids`` for each of ``keys`` of ``batch`` outside the vocabulary."""
    if vocab_size is None or isinstance(batch, CheckedBatch):
        return
    for key in keys:
        check_token_ids(batch[key], vocab_size, f"the micro-batch's {key}")


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    seq_length: int
    hidden_size: int
    dtype: torch.dtype = torch.float32  # of the activations between pipeline stages
    device: torch.device = torch.device("cpu")
    tp: int = 1
    sequence_parallel: bool = False  # activations between layers are split over TP along the sequence
    cp: int = 1  # context-parallel ranks the sequence is split over
    cp_rank: int = 0
    reset_position_ids: bool = False
    calculate_per_token_loss: bool = False
    cp_group: object = field(default=None, compare=False)  # for the token count of the CP group
    vocab_size: Optional[int] = None  # token ids and labels must be below it (checked on the host); None: unchecked

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))
        split = (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sequence_parallel else 1)
        if self.seq_length % split:
            raise ValueError(f"sequence length {self.seq_length} is not divisible by {split} (2 x context-parallel "
                             f"size {self.cp} x tensor-parallel size {self.tp} with sequence parallelism)")

    @classmethod
    def from_config(cls, cfg, dims: ParallelDims, device: torch.device, dtype: torch.dtype) -> "BatchLayout":
        """The layout of a run: ``cfg`` its resolved Config, ``dtype`` the parameters' dtype."""
        par = cfg.parallel
        return cls(micro_batch_size=cfg.train.micro_batch_size, seq_length=cfg.model.seq_length,
                   hidden_size=cfg.model.hidden_size, dtype=dtype, device=device, tp=dims.tp,
                   sequence_parallel=bool(par.sequence_parallel and dims.tp > 1), cp=dims.cp,
                   cp_rank=dims.cp_rank, cp_group=dims.cp_group,
                   reset_position_ids=cfg.data.reset_position_ids or cfg.data.sft,  # SFT: per conversation
                   calculate_per_token_loss=cfg.train.calculate_per_token_loss,
                   vocab_size=None if cfg.data.no_token_id_check else cfg.data.vocab_size)

    # ---- this rank's part of the sequence ---------------------------------------------------------
    @property
    def local_seq_length(self) -> int:
        return self.seq_length // self.cp

    def slice_sequence(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a tensor along its sequence dimension ``dim``."""
        return split_sequence(t, self.cp, self.cp_rank, dim)

    def position_ids(self, batch: dict) -> torch.Tensor:
        """[b, s] positions of the whole sequence, on the device: the data's own with
        --reset-position-ids, else 0 .. s-1 for every sample."""
        given: Optional[torch.Tensor] = batch.get("position_ids")
        if self.reset_position_ids and given is not None:
            return given.to(self.device, non_blocking=True)
        b, s = batch["tokens"].shape
        return torch.arange(s, device=self.device).expand(b, s)

    def prepare(self, batch: dict) -> dict:
        """A micro-batch from the data iterator (tokens, labels, loss_mask [b, s], optional
        position_ids, document_ids, attention_mask) as this rank's model and loss inputs, on the
        device: everything sliced to this rank's part of the sequence but the document ids."""
        # Positions 0 .. s-1 of a whole (unsliced) sequence go as None: the model makes them itself
        # and reads its rotary table as one contiguous slice instead of a [s, b] gather.
        plain = not self.reset_position_ids and self.cp == 1
        check_batch_ids(batch, self.vocab_size, ID_KEYS["gpt"])  # on the loader's host tensors: no device sync
        out = {"position_ids": None if plain else self.slice_sequence(self.position_ids(batch))}
        for key in ("tokens", "labels", "loss_mask"):
            out[key] = self.slice_sequence(batch[key].to(self.device, non_blocking=True))
        for key in ("document_ids", "attention_mask"):
            value = batch.get(key)
            out[key] = value.to(self.device, non_blocking=True) if value is not None else None
        if self.cp > 1 and out["attention_mask"] is not None:
            raise ValueError("a dense attention mask cannot be split over context-parallel ranks; give the "
                             "batch document_ids (--reset-attention-mask does) instead")
        return out

    # ---- the loss ---------------------------------------------------------------------------------
    def microbatch_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor, num_microbatches: int):
        """What one micro-batch backpropagates (see ``microbatch_loss``). Under context parallelism
        (default normalisation) this rank's loss sum over the CP group's token count, times CP."""
        if self.cp > 1 and not self.calculate_per_token_loss:
            total = num_tokens.detach().to(torch.float32).clone()
            if self.cp_group is not None:
                dist.all_reduce(total, group=self.cp_group)
            return microbatch_loss(loss_sum * self.cp, total, num_microbatches)
        return microbatch_loss(loss_sum, num_tokens, num_microbatches, self.calculate_per_token_loss)

    # ---- pipeline boundaries ----------------------------------------------------------------------
    def activation_shape(self) -> tuple[int, int, int]:
        """[s/CP/(TP with sequence parallelism), b, h]: the hidden states between two stages."""
        s = self.local_seq_length // (self.tp if self.sequence_parallel else 1)
        return (s, self.micro_batch_size, self.hidden_size)

    def p2p_specs(self) -> list[TensorSpec]:
        """What each pipeline transfer moves, in order (the GPT model: its hidden states)."""
        return [TensorSpec(self.activation_shape(), self.dtype)]
