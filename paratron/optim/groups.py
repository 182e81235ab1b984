"""Which optimizer rules each parameter follows, by Megatron's parameter-group rules:

* weight decay: none for biases and 1-D parameters (norm weights), except the q/k layernorm
  parameters with ``--apply-wd-to-qk-layernorm``;
* ``--decoupled-lr``: the word embedding and the output layer (Megatron's
  ``is_embedding_or_output_parameter``; a pipeline stage's copy of a tied embedding included) follow the
  LR schedule with their own peak and minimum;
* ``--use-mup`` with a width multiplier m != 1: the hidden weight matrices stepped by Adam (2-D and
  more; neither the embeddings nor the output layer) take LR / m and Adam epsilon / m (Megatron's muP
  groups; paratron/model/mup.py);
* ``--mtp-detach-heads``: the MTP layers' gradients are clipped by their own norm, left out of the
  model's (the reported) gradient norm (Megatron's ``grad_norm_group`` "mtp");
* ``--optimizer muon``: Muon steps the hidden weight matrices (2-D, neither the word embedding nor the
  output layer; paratron's stacked expert weights [experts, out, in] are one matrix per expert, as
  Megatron's per-expert weights); AdamW steps everything else.

Parameters are recognised by their names in the model (``embedding.word_embeddings.weight``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import mup

EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
EMBEDDING_CLASS = EMBEDDING_OR_OUTPUT + ("embedding.position_embeddings.weight",)  # muP's base-LR matrices
QK_NORMS = ("q_layernorm.", "k_layernorm.")


@dataclass(frozen=True)
class Role:
    decay: bool  # weight decay applies
    decoupled: bool  # --decoupled-lr applies (word embedding, output layer)
    matrix: bool  # Muon steps it (with --optimizer muon)
    hidden: bool = False  # muP: a hidden weight matrix stepped by Adam (LR and epsilon / m)
    own_norm: bool = False  # --mtp-detach-heads: an MTP layer's, clipped by the MTP layers' own gradient norm


def role_of(name: str, ndim: int, op, model=None) -> Role:
    """The role of parameter ``name`` (its name in the model, any wrapper prefix allowed) with ``ndim``
    dimensions, under the optim section ``op`` and the model section ``model`` (muP, MTP heads)."""
    bias = name.endswith(".bias")
    no_decay = bias or ndim == 1
    if op.apply_wd_to_qk_layernorm and any(k in name for k in QK_NORMS):
        no_decay = False
    embedding_or_output = name.endswith(EMBEDDING_OR_OUTPUT)
    stacked_expert = ndim == 3 and ".experts." in f".{name}"
    matrix = op.optimizer == "muon" and not embedding_or_output and not bias and (ndim == 2 or stacked_expert)
    scaled = model is not None and mup.scales_optimizer(model)
    hidden = scaled and not matrix and ndim >= 2 and not name.endswith(EMBEDDING_CLASS)
    own = model is not None and model.mtp_detach_heads and ".mtp.layers." in f".{name}"
    return Role(decay=not no_decay, decoupled=op.decoupled_lr is not None and embedding_or_output, matrix=matrix,
                hidden=hidden, own_norm=own)


def roles(models: list, op) -> dict:
    """{parameter: Role} of every trainable parameter of the model chunks."""
    return {p: role_of(name, p.dim(), op) for m in models for name, p in m.named_parameters() if p.requires_grad}
