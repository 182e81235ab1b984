"""The model chunks of each pipeline rank, and their parameters' global names (the split of the layers
over stages is the config's: paratron/config/pipeline_split.py).

Stages get equal shares of ``--num-layers`` by default; ``--decoder-first-pipeline-num-layers`` and
``--decoder-last-pipeline-num-layers`` fix the first and last stage's counts and the stages between
share the rest equally. With interleaving (``--virtual-pipeline-model-parallel-size V``) each stage's
layers are cut into V equal chunks and the model is the chain of virtual stages

    chunk 0 of stage 0, chunk 0 of stage 1, ..., chunk 0 of stage P-1, chunk 1 of stage 0, ...

so virtual stage ``s = v * P + r`` is chunk ``v`` of pipeline rank ``r`` (Megatron's layout). The
embedding lives on virtual stage 0, the final norm, output layer and loss on the last one.
"""
from __future__ import annotations

import re

from ..config.pipeline_split import chunk_layers


def rank_chunks(cfg, pp_rank: int) -> list[dict]:
    """GPTModel arguments of each model chunk of pipeline rank ``pp_rank``, in virtual order."""
    par = cfg.parallel
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    layout = chunk_layers(cfg.model.num_layers, pp, vpp, par.decoder_first_pipeline_num_layers,
                          par.decoder_last_pipeline_num_layers, par.pipeline_model_parallel_layout)
    chunks = []
    for v in range(vpp):
        offset, n = layout[(v, pp_rank)]
        stage = v * pp + pp_rank
        chunks.append(dict(pre_process=stage == 0, post_process=stage == pp * vpp - 1, layer_offset=offset,
                           num_layers=n))
    return chunks


_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")


def global_name(name: str, layer_offset: int) -> str:
    """A chunk's parameter name with its layer index made global (``decoder.layers.0.x`` on a chunk
    starting at layer 6 is ``decoder.layers.6.x``; ``encoder.layers`` of an encoder alike): the name in the
    one-stage model."""
    return _LAYER.sub(lambda m: f"{m.group(1)}.layers.{int(m.group(2)) + layer_offset}.", name)


def unwrap(module):
    """The model inside wrappers (DataParallel and the like keep it in ``.module``)."""
    while not hasattr(module, "set_input_tensor") and hasattr(module, "module"):
        module = module.module
    return module


def global_named_parameters(chunks) -> dict:
    """This rank's parameters of every chunk under their one-stage-model names."""
    out = {}
    for chunk in chunks:
        m = unwrap(chunk)
        for name, p in m.named_parameters():
            out[global_name(name, m.decoder.layer_offset)] = p
    return out
