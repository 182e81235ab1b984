"""A streamed response's host work, kept small per token: its text (``TextStream``: decoded once per chunk, not
twice per token) and its server-sent events (``SseChunks``: the JSON of a chunk written from parts encoded once
per response, byte for byte what ``json.dumps`` of the chunk's envelope writes).

At hundreds of streams every token crosses the event loop, which shares the GIL with the generation thread:
host time spent here per token is time the engine's steps wait (benchmarks/serve_host.py measures it).
"""
from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii as _quote  # what json.dumps writes for a str (ensure_ascii)
from typing import Optional

from .sampling import find_stop


class TextStream:
    """The text of one streamed row, sent as it grows. Text that may be the start of a stop string,
    and a trailing incomplete character, wait until the next token decides."""

    def __init__(self, detokenize, stops: tuple):
        self.detokenize, self.stops = detokenize, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list = []
        self.sent = ""
        self.text = ""  # the text of tokens[:read], final (no incomplete character at its end)
        self.start = self.read = 0  # tokens[start:read]: the context the next tokens are decoded after

    def _text(self) -> str:
        """The row's text: only the tokens since ``start`` decoded (with the last ones as context, so that a
        tokenizer's joining of pieces comes out as in a whole decode), not the whole row each token."""
        window = self.detokenize(self.tokens[self.start:])
        before = self.detokenize(self.tokens[self.start:self.read]) if self.read > self.start else ""
        if not window.startswith(before):  # a decoder that rewrites the context: decode the whole row
            self.text, self.start, self.read = "", 0, 0
            return self._text()
        new = window[len(before):]
        if new.endswith("\ufffd"):  # an incomplete character: the next token decides
            return self.text + new
        self.text += new
        self.start, self.read = self.read, len(self.tokens)
        return self.text

    def push(self, token: Optional[int]) -> str:
        return self.push_all([token])

    def push_all(self, tokens: list) -> str:
        """The text not sent yet after ``tokens`` (the row's new tokens, None: none), decoded once for all."""
        tokens = [t for t in tokens if t is not None]
        if not tokens:
            return ""
        self.tokens.extend(tokens)
        text = self._text()
        cut = find_stop(text, self.stops) if self.stops else None
        safe = text[:cut] if cut is not None else text[:len(text) - self.hold]
        return self.rest(safe.rstrip("\ufffd"))

    def rest(self, text: str) -> str:
        """What of ``text`` (the row's text so far or final) has not been sent; sends it."""
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class SseChunks:
    """The server-sent events of one streamed completion (``chat``: a chat completion's chunks), each the bytes of
    ``sse(api.envelope(kind, cid, model, [choice]))``: the id, object and model encoded once, ``created`` the time
    of each chunk, as the envelope has it."""

    def __init__(self, cid: str, model: str, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.chat = chat
        self.head = f'data: {{"id": {_quote(cid)}, "object": {_quote(kind)}, "created": '
        self.model = f', "model": {_quote(model)}, "choices": [{{"index": '

    def __call__(self, i: int, delta: str, reason: Optional[str]) -> str:
        """The chunk of choice ``i``: its text ``delta``, or its end (``reason``: the finish reason)."""
        if not self.chat:
            body = f'"text": {_quote(delta)}'
        elif reason is None:
            body = f'"delta": {{"content": {_quote(delta)}}}'
        else:
            body = '"delta": {}'
        end = "null" if reason is None else _quote(reason)
        return (f'{self.head}{int(time.time())}{self.model}{int(i)}, {body}, "logprobs": null, '
                f'"finish_reason": {end}}}]}}\n\n')

    def role(self, i: int) -> str:
        """A chat response's first chunk of choice ``i``: the assistant's role and empty content."""
        return (f'{self.head}{int(time.time())}{self.model}{int(i)}, "delta": {{"role": "assistant", "content": ""}}, '
                '"logprobs": null, "finish_reason": null}]}\n\n')
