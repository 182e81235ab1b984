"""The HTTP API's request bodies (pydantic; unknown fields are refused) and their answers.

Megatron's ``PUT /api`` (tools/run_text_generation_server.py) and OpenAI's ``/v1/completions`` and
``/v1/chat/completions``. Fields that OpenAI defines but paratron does not implement are accepted only
at their neutral value (``presence_penalty`` 0, ``best_of`` 1, ...); any other value is a 400 naming
the field.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .sampling import SamplingParams


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error body naming ``param``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else None

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MegatronRequest(_Strict):
    """Megatron's PUT /api. ``top_p`` 0 and ``top_k`` 0 mean off; ``temperature`` 0 is greedy (Megatron
    itself refuses 0); ``add_BOS`` prepends the end-of-document token as Megatron does."""
    prompts: list[str] = Field(min_length=1)
    tokens_to_generate: int = Field(64, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(0.0, ge=0.0, le=1.0)
    logprobs: bool = False
    add_BOS: bool = False
    random_seed: Optional[int] = Field(None, ge=0)

    def params(self) -> SamplingParams:
        return SamplingParams(self.tokens_to_generate, self.temperature, self.top_k, self.top_p or 1.0,
                              self.random_seed, (), False, self.logprobs)


class _OpenAI(_Strict):
    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's; as vLLM and others accept it
    n: int = Field(1, ge=1, le=32)
    stream: bool = False
    stream_options: Optional[dict] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None

    def refuse_unsupported(self) -> None:
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}
        for name, value in neutral.items():
            if getattr(self, name) not in (value, {}):
                raise ApiError(400, f"{name}: not supported by paratron (only {value!r})", name)

    def stops(self) -> tuple:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_OpenAI):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=1)
    suffix: Optional[str] = None

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise ApiError(400, "prompt: is empty", "prompt")
        return list(p)

    def params(self, default_max: int) -> SamplingParams:
        self.refuse_unsupported()
        if self.suffix is not None:
            raise ApiError(400, "suffix: not supported by paratron", "suffix")
        n = self.max_tokens if self.max_tokens is not None else default_max
        return SamplingParams(n, self.temperature, self.top_k, self.top_p, self.seed, self.stops(), False,
                              self.logprobs is not None, self.logprobs or 0)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "messages: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_OpenAI):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def params(self, default_max: int, extra_stops: tuple) -> SamplingParams:
        self.refuse_unsupported()
        n = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), default_max)
        return SamplingParams(n, self.temperature, self.top_k, self.top_p, self.seed, self.stops() + extra_stops,
                              False, self.logprobs, self.top_logprobs or 0)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(results) -> dict:
    prompt = sum(len(r.prompt) for r in results)
    done = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def envelope(kind: str, cid: str, model: str, choices: list, results=None) -> dict:
    out = {"id": cid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if results is not None:
        out["usage"] = usage(results)
    return out


def completion_logprobs(model, res, echo: bool, prompt_text: str) -> dict:
    """OpenAI's legacy ``logprobs`` object of one completion."""
    ids = (res.prompt if echo else []) + res.tokens
    lps = ((res.prompt_logprobs or [None] * len(res.prompt)) if echo else []) + (res.logprobs or [])
    tokens = model.token_text(ids)
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if res.top_logprobs is not None:
        top = ([None] * len(res.prompt) if echo else []) + [
            {model.token_text([i])[0]: v for i, v in step} for step in res.top_logprobs]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(model, res) -> dict:
    content = []
    for k, (tok, lp) in enumerate(zip(res.tokens, res.logprobs or [])):
        text = model.token_text([tok])[0]
        top = [{"token": model.token_text([i])[0], "logprob": v,
                "bytes": list(model.token_text([i])[0].encode())} for i, v in (res.top_logprobs or [[]] * (k + 1))[k]]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}
