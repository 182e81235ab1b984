"""Text in, text out: prompts through the tokenizer into requests, results back into text, chat
messages into a prompt.

Chat prompts use the ``chat_template`` of the tokenizer's ``tokenizer_config.json`` when it has one
(rendered with jinja2, as transformers does); otherwise the plain template::

    system: <content>
    user: <content>
    assistant:

one line per message then ``assistant:``; with it, generation also stops at a new ``user:`` line.
"""
from __future__ import annotations

import dataclasses

import json
from pathlib import Path
from typing import Optional

from ..checkpoint.tokenizer_files import SUBDIR
from ..data.chat_template import render_template
from .engine import Request, Result
from .sampling import SamplingParams

PLAIN_STOPS = ("\nuser:",)


def chat_template(path) -> Optional[str]:
    """The chat template of the tokenizer files at checkpoint / HF directory ``path``, or None."""
    root = Path(path)
    for d in (root, root / SUBDIR):
        f = d / "tokenizer_config.json"
        if f.is_file():
            try:
                value = json.loads(f.read_text()).get("chat_template")
            except ValueError:
                return None
            return value if isinstance(value, str) else None
    return None


def render_chat(messages: list[dict], template: Optional[str], special: dict) -> tuple[str, tuple]:
    """(prompt text, extra stop strings) of chat ``messages`` [{"role", "content"}]."""
    if template:
        return render_template(template, messages, special, True), ()
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"]), PLAIN_STOPS


class TextModel:
    """A :class:`~paratron.inference.runtime.Group` with its tokenizer: prompts as text."""

    def __init__(self, group, tokenizer, name: str, template: Optional[str] = None):
        self.group, self.tok, self.name, self.template = group, tokenizer, name, template
        self.engine = group.engine

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self.tok.tokenize(text))
        if add_bos and self.tok.eod is not None:  # Megatron's add_BOS prepends the end-of-document token
            ids = [self.tok.eod] + ids
        return ids

    def requests(self, prompts: list, params: SamplingParams, add_bos: bool = False, first: int = 0) -> list[Request]:
        """One request per prompt (text, or a list of token ids); prompt j (counted from ``first``) of a
        seeded request gets its own draws (SamplingParams.seed_offset j)."""
        return [Request(p if isinstance(p, list) else self.encode(p, add_bos),
                        params if params.seed is None else dataclasses.replace(params, seed_offset=first + j))
                for j, p in enumerate(prompts)]

    def check(self, requests: list[Request]) -> Optional[str]:
        return next((p for p in (self.engine.check(r) for r in requests) if p), None)

    def run(self, requests: list[Request], on_step=None) -> list[Result]:
        return self.group.generate(requests, on_step)

    def token_text(self, ids: list[int]) -> list[str]:
        return [self.tok.detokenize([i]) for i in ids]

    def special_tokens(self) -> dict:
        eod = self.tok.eod
        text = self.tok.detokenize([eod]) if eod is not None else ""
        return {"eos_token": text, "bos_token": text}
