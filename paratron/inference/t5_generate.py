"""Encoder-decoder generation (T5): the encoder runs once over the prompts; the decoder starts from its start token
(``decoder_start``, Hugging Face's ``decoder_start_token_id``: 0, the padding id) and adds one token per step over
a KV cache of its self-attention (paratron/inference/cache.py), the cross-attention's keys and values of the
encoder's output made once and kept for every step. The next token is chosen as ``paratron generate`` chooses it
(greedy at temperature 0, else sampled with top-k / top-p: paratron/inference/sampling.py); a row that produced
its end token (``eos``) is finished and continues with the padding id, as Hugging Face's ``generate``.

``paratron generate --load T5_CHECKPOINT_OR_HF_DIR --prompt TEXT`` runs it on one process.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import ConfigError
from .cache import CacheView, KVCache
from .engine import Result
from .sampling import Sampler, SamplingParams


@torch.no_grad()
def generate_t5(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], params: SamplingParams,
                vocab_size: int, eos: Optional[int], decoder_start: int = 0, pad: int = 0) -> torch.Tensor:
    """[b, n <= max_new_tokens] generated ids of ``input_ids`` [b, s] (``attention_mask`` [b, s]: 1 = a real
    token; None: all are), the start token not included."""
    model.eval()
    b, device = input_ids.size(0), input_ids.device
    padding = attention_mask.bool() if attention_mask is not None else None
    memory = model.encode(input_ids, padding)
    cross = model.cross_context(padding)  # its memo keeps each layer's encoder keys / values across steps
    n = params.max_new_tokens
    cache = KVCache(model, b, max(n, 1), device=device, dtype=memory.dtype)
    sampler = Sampler([params] * b, device)
    last = torch.full((b, 1), decoder_start, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out = []
    for t in range(n):
        view = CacheView(cache, torch.tensor([t], device=device), t + 1)
        ctx = model.decoder_context(1, t + 1, None, memory.dtype, offset=t, kv_cache=view)
        logits = model.logits(model.decode(last, memory, cross, ctx, offset=t))[:, -1, :vocab_size]
        token = torch.where(done, torch.full_like(done, pad, dtype=torch.long), sampler(logits))
        out.append(token)
        if eos is not None:
            done |= token == eos
        last = token[:, None]
        if bool(done.all()):
            break
    return torch.stack(out, 1) if out else torch.zeros(b, 0, dtype=torch.long, device=device)


def generate_main(args, params: SamplingParams) -> int:
    """``paratron generate`` of a T5 checkpoint or Hugging Face T5 directory (one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun: the launch, not a switch
    if world > 1:
        raise ConfigError(f"T5 generation runs in one process, not {world}: run `paratron generate` without torchrun "
                          "(or with --nproc-per-node 1)")
    from .cli import _print, read_prompts
    from .load import load_for_inference
    loaded = load_for_inference(args.load, None, args.device or "cpu", args.dtype, args.iteration)
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"--load {args.load}: no tokenizer saved with it; pass --tokenizer-model PATH")
    eos = None if params.ignore_eod else _eos(tok)
    for prompt in read_prompts(args):
        ids = torch.tensor([tok.tokenize(prompt)], device=args.device or "cpu")
        tokens = generate_t5(loaded.model, ids, None, params, loaded.vocab_size, eos)[0].tolist()
        finished = eos is not None and eos in tokens
        tokens = tokens[:tokens.index(eos)] if finished else tokens
        _print(prompt, Result(ids[0].tolist(), tokens, "stop" if finished else "length", tok.detokenize(tokens)),
               args.json)
    return 0


def _eos(tok) -> Optional[int]:
    for name in ("eos", "eod"):
        value = getattr(tok, name, None)
        if value is not None:
            return int(value)
    return None
