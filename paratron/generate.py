"""Sampling text from a trained model (one process; no KV cache yet: the demo's models are small)."""
from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, token_ids: list[int], max_new_tokens: int, vocab_size: int, temperature: float = 0.8,
             top_k: int = 40, eod: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """Extend ``token_ids`` by sampling; stops at ``eod``. Logits of padded vocabulary rows are ignored."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    limit = model.config.max_position_embeddings if model.config.position_embedding_type == "learned_absolute" \
        else model.config.seq_length
    out = list(token_ids)
    for _ in range(max_new_tokens):
        ctx = ids[:, -limit:]
        logits = model(ctx)[0, -1, :vocab_size].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        if eod is not None and nxt == eod:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return out
