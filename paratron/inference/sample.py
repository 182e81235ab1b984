"""``--sample-prompt``: at the end of training, the trained model continues the prompt (greedy, up to
:data:`SAMPLE_TOKENS` new tokens or the end-of-document token). Every rank runs it on its TP shard
(the prompt is the same everywhere: no broadcast); the logging rank prints it."""
from __future__ import annotations

import torch

from .engine import Engine, Request
from .sampling import SamplingParams

SAMPLE_TOKENS = 64


def training_sample(model, tokenizer, cfg) -> str:
    """The text ``model`` (one pipeline stage holding the whole model) adds to ``cfg.log.sample_prompt``."""
    was_training = model.training
    engine = Engine(model, cfg.data.vocab_size, tokenizer.eod, tokenizer.detokenize)
    prompt = tokenizer.tokenize(cfg.log.sample_prompt) or [tokenizer.eod or 0]
    prompt = prompt[-(engine.context - 1):]
    try:
        with torch.autocast(engine.device.type, enabled=False):
            return engine.generate([Request(prompt, SamplingParams(SAMPLE_TOKENS))])[0].text
    finally:
        model.train(was_training)
