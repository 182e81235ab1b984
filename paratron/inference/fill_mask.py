"""Fill-mask with a BERT (``--model bert`` checkpoint, or a Hugging Face megatron-bert directory):

    paratron fill-mask --load CKPT --text "The capital of France is [MASK]." [--top-k 5] [--json]

or from Python: ``FillMask.load(path).predict(text, top_k)``. The text is tokenized around each ``[MASK]``
(the WordPiece vocabulary's [MASK] id goes in its place), framed as ``[CLS] text [SEP]`` (tokentype 0 when the
model has tokentypes) and run through the model in one bidirectional pass; each mask position gets the top-k
tokens of the LM head's softmax over the real vocabulary (the padded rows are left out).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError

MASK = "[MASK]"


@dataclass
class Prediction:
    position: int  # the mask's token position in [CLS] ... [SEP]
    tokens: list[str]
    ids: list[int]
    probs: list[float]


class FillMask:
    def __init__(self, model, tokenizer, vocab_size: int):
        from ..model.bert import BertModel
        if not isinstance(model, BertModel):
            raise ConfigError("fill-mask needs a BERT (--model bert) checkpoint; this one holds a GPT model")
        if not hasattr(tokenizer, "mask"):
            raise ConfigError("fill-mask needs the WordPiece tokenizer of a BERT (BertWordPieceLowerCase / Case)")
        self.model, self.tok, self.vocab = model.eval(), tokenizer, vocab_size

    @classmethod
    def load(cls, path, device="cpu", dtype: Optional[str] = None, iteration: Optional[int] = None) -> "FillMask":
        from .load import load_for_inference
        loaded = load_for_inference(path, device=device, dtype=dtype, iteration=iteration)
        if loaded.tokenizer is None:
            raise ConfigError(f"--load {path}: no tokenizer saved with it (a BERT vocab.txt)")
        return cls(loaded.model, loaded.tokenizer, loaded.vocab_size)

    def ids(self, text: str) -> list[int]:
        """[CLS] text [SEP] with the [MASK] id at each ``[MASK]``."""
        parts = text.split(MASK)
        if len(parts) < 2:
            raise ConfigError(f"fill-mask: the text has no {MASK} to fill")
        out = [self.tok.cls]
        for i, part in enumerate(parts):
            out += self.tok.tokenize(part) if part.strip() else []
            if i < len(parts) - 1:
                out.append(self.tok.mask)
        return out + [self.tok.sep]

    @torch.no_grad()
    def predict(self, text: str, top_k: int = 5) -> list[Prediction]:
        ids = self.ids(text)
        limit = self.model.config.max_position_embeddings
        if len(ids) > limit:
            raise ConfigError(f"fill-mask: {len(ids)} tokens, more than the model's {limit} positions")
        device = self.model.output_layer.bias.device
        x = torch.tensor([ids], device=device)
        types = torch.zeros_like(x) if self.model.add_binary_head else None
        logits, _ = self.model(x, padding_mask=torch.ones_like(x, dtype=torch.bool), tokentype_ids=types)
        probs = torch.softmax(logits[0, :, :self.vocab].float(), dim=-1)
        out = []
        for pos in (i for i, t in enumerate(ids) if t == self.tok.mask):
            p, top = probs[pos].topk(min(top_k, self.vocab))
            names = [self.tok.inv_vocab[int(i)] for i in top]
            out.append(Prediction(pos, names, top.tolist(), p.tolist()))
        return out


def fill_mask_main(argv: list[str]) -> int:
    from ..errors import ArgumentParser
    p = ArgumentParser(prog="paratron fill-mask", description="Fill the [MASK] tokens of a text with a BERT.")
    p.add_argument("--load", required=True, help="a BERT checkpoint (--model bert) or a megatron-bert HF directory")
    p.add_argument("--text", required=True, action="append", help=f"a text with {MASK} (repeatable)")
    p.add_argument("--top-k", type=int, default=5, help="candidates per mask")
    p.add_argument("--iteration", type=int, help="this iteration of the checkpoint instead of the latest")
    p.add_argument("--json", action="store_true", help="one JSON line per text")
    args = p.parse_args(argv)
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: at least 1")
    fm = FillMask.load(args.load, iteration=args.iteration)
    for text in args.text:
        preds = fm.predict(text, args.top_k)
        if args.json:
            print(json.dumps({"text": text, "masks": [vars(pr) for pr in preds]}))
            continue
        print(text)
        for pr in preds:
            print(f"  [MASK] at {pr.position}: " + ", ".join(f"{t} {q:.3f}" for t, q in zip(pr.tokens, pr.probs)))
    return 0
