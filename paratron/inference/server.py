"""``paratron serve``: a FastAPI app on uvicorn in front of the batched generator.

Routes: Megatron's ``PUT /api``; OpenAI's ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream: true`` as server-sent events), ``GET /v1/models``; ``GET /health``. A bad request (malformed
JSON, an unknown field, a value out of range, a prompt longer than the context) is a 4xx with an
OpenAI-style JSON error naming the field; the server goes on.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from .api import (ApiError, ChatRequest, CompletionRequest, MegatronRequest, chat_logprobs, completion_id,
                  completion_logprobs, envelope)
from .batcher import Batcher, Job
from .streaming import SseChunks, TextStream, sse as _sse
from .text import render_chat


def _error_response(err: ApiError):
    from fastapi.responses import JSONResponse
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_error(exc) -> ApiError:
    """The first pydantic / JSON problem of a request body as one ApiError naming the field."""
    e = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    field = ".".join(loc) or "body"
    kind = e.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"body: malformed JSON ({e.get('ctx', {}).get('error', 'cannot parse')})", "body")
    if kind == "extra_forbidden":
        return ApiError(400, f"{field}: unknown field", field)
    if kind == "missing":
        return ApiError(400, f"{field}: required", field)
    return ApiError(400, f"{field}: {e.get('msg', 'invalid value')}", field)


class Server:
    """The app's state: the model, the batcher, the model's name. ``limits``: config/inference.py's
    InferenceConfig (the engine and the queue limits; None: its defaults)."""

    def __init__(self, model, max_batch: int, wait: float, name: str, continuous: bool = False, limits=None):
        from ..config.inference import InferenceConfig
        self.model, self.name = model, name
        self.limits = limits or InferenceConfig()
        self.default_max = 16
        self.engine = None  # the paged engine, when the config asks for it
        if self.limits.inference_dynamic_batching:  # one pool of KV blocks, requests join between steps (paged.py)
            from .paged_batcher import PagedBatcher
            self.engine = model.group.paged(self.limits)  # built on every TP rank (runtime.Group)
            self.engine.warm_up()  # every decode bucket compiled and captured before the first request
            print(self.engine.startup_line(), flush=True)
            self.batcher = PagedBatcher(self.engine)
        elif continuous:  # requests join running batches (continuous.py)
            from .continuous import ContinuousBatcher
            self.batcher = ContinuousBatcher(model.engine, max_batch, wait)
        else:
            self.batcher = Batcher(model.run, max_batch, wait)
        self.started = int(time.time())
        self.queued = [0, 0]  # requests and tokens (prompt + max new) submitted and not yet answered
        self.answered = 0

    def _check(self, requests: list, field: str) -> None:
        """Engine.check's 'name: why' as a 400; a problem of the prompt is named after ``field``."""
        problem = self.model.check(requests)
        if problem is None and self.engine is not None:
            problem = next((p for p in map(self.engine.check, requests) if p), None)
        if problem:
            name, why = problem.split(":", 1)
            name = field if name == "prompt" else name
            raise ApiError(400, f"{name}:{why}", name)

    def _model_name(self, asked: Optional[str]) -> None:
        if asked is not None and asked != self.name:
            raise ApiError(404, f"model: {asked!r} is not served here; this server serves {self.name!r}", "model")

    async def submit(self, requests: list, field: str, stream: bool = False) -> Job:
        self._check(requests, field)
        tokens = sum(len(r.prompt) + r.params.max_new_tokens for r in requests)
        self._admit(len(requests), tokens)
        job = Job(requests, asyncio.get_running_loop(), stream)
        self.queued[0] += len(requests)
        self.queued[1] += tokens
        job.future.add_done_callback(lambda _: self._answered(len(requests), tokens))
        self.batcher.submit(job)
        return job

    def _answered(self, requests: int, tokens: int) -> None:
        self.queued[0] -= requests
        self.queued[1] -= tokens
        self.answered += requests

    def retry_after(self) -> int:
        """Seconds until the requests queued now are likely answered, at the rate answered so far (1..60)."""
        rate = self.answered / max(time.time() - self.started, 1e-3)
        return int(min(60, max(1, -(-self.queued[0] // max(rate, 1e-3)))))

    def _admit(self, requests: int, tokens: int) -> None:
        """503 while the generation thread is down, 429 past --serve-max-queued-requests / -tokens; both with
        Retry-After."""
        if not self.batcher.alive:
            raise ApiError(503, "the generation thread has stopped; the server cannot generate", retry_after=60)
        most, most_tokens = self.limits.serve_max_queued_requests, self.limits.serve_max_queued_tokens
        if most and self.queued[0] + requests > most:
            raise ApiError(429, f"too many requests in flight: {self.queued[0]} queued or running, the server "
                                f"takes {most} (--serve-max-queued-requests); retry later",
                           retry_after=self.retry_after())
        if most_tokens and self.queued[1] + tokens > most_tokens:
            raise ApiError(429, f"too many tokens in flight: {self.queued[1]} (prompt + max new tokens) queued or "
                                f"running, the server takes {most_tokens} (--serve-max-queued-tokens); retry later",
                           retry_after=self.retry_after())

    async def results(self, job: Job) -> list:
        try:
            return await job.future
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        except Exception as e:  # noqa: BLE001 - a failed batch answers its requests, the server goes on
            raise ApiError(500, f"generation failed: {e.__class__.__name__}: {e}") from None

    # ---- Megatron -------------------------------------------------------------------------
    async def megatron(self, body: MegatronRequest) -> dict:
        params = body.params()
        requests = self.model.requests(body.prompts, params, body.add_BOS)
        results = await self.results(await self.submit(requests, "prompts"))
        text, segments, logprobs = [], [], []
        for prompt, res in zip(body.prompts, results):
            text.append(prompt + (res.text or ""))
            segments.append(self.model.token_text(res.prompt + res.tokens))
            if body.logprobs:
                logprobs.append((res.prompt_logprobs or [None])[1:] + (res.logprobs or []))
        return {"text": text, "segments": segments, "logprobs": logprobs if body.logprobs else None}

    # ---- OpenAI ---------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        self._model_name(body.model)
        params = body.params(self.default_max)
        prompts = [p for p in body.prompts() for _ in range(body.n)]
        requests = self.model.requests(prompts, params)
        job = await self.submit(requests, "prompt", body.stream)
        cid = completion_id("cmpl")
        if body.stream:
            return self._stream(job, params.stop, SseChunks(cid, self.name, chat=False),
                                prefix=[p if body.echo and isinstance(p, str) else "" for p in prompts])
        results = await self.results(job)
        choices = []
        for i, (p, res) in enumerate(zip(prompts, results)):
            echo = (p if isinstance(p, str) else self.model.tok.detokenize(p)) if body.echo else ""
            lp = completion_logprobs(self.model, res, body.echo, echo) if body.logprobs is not None else None
            choices.append({"index": i, "text": echo + (res.text or ""), "logprobs": lp,
                            "finish_reason": res.finish_reason})
        return envelope("text_completion", cid, self.name, choices, results)

    async def chat(self, body: ChatRequest):
        self._model_name(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt, stops = render_chat(messages, self.model.template, self.model.special_tokens())
        except Exception as e:  # noqa: BLE001 - a template that fails on these messages
            raise ApiError(400, f"messages: the chat template cannot render them ({e})", "messages") from None
        params = body.params(self.default_max, stops)
        requests = self.model.requests([prompt] * body.n, params)
        job = await self.submit(requests, "messages", body.stream)
        cid = completion_id("chatcmpl")
        if body.stream:
            chunk = SseChunks(cid, self.name, chat=True)
            return self._stream(job, params.stop, chunk, first=[chunk.role(i) for i in range(body.n)])
        results = await self.results(job)
        choices = [{"index": i, "message": {"role": "assistant", "content": res.text or ""},
                    "logprobs": chat_logprobs(self.model, res) if body.logprobs else None,
                    "finish_reason": res.finish_reason} for i, res in enumerate(results)]
        return envelope("chat.completion", cid, self.name, choices, results)

    def _stream(self, job: Job, stops: tuple, chunk, first=(), prefix=None):
        from fastapi.responses import StreamingResponse
        streams = [TextStream(self.model.tok.detokenize, stops) for _ in job.requests]

        async def events():
            for c in first:
                yield c
            for i, p in enumerate(prefix or []):
                if p:
                    yield chunk(i, p, None)
            while True:
                steps = await job.steps.take()  # every step queued since the last chunk went out: one chunk
                ended = steps[-1] is None  # (the end is the last thing a job queues)
                steps = [step for step in steps if step is not None]
                for i, stream in enumerate(streams):
                    delta = stream.push_all([step[i] for step in steps])
                    if delta:
                        yield chunk(i, delta, None)
                if ended:
                    break
            try:
                results = await self.results(job)
            except ApiError as e:
                yield _sse(e.body())
                return
            for i, res in enumerate(results):
                rest = streams[i].rest(res.text or "")
                if rest:
                    yield chunk(i, rest, None)
                yield chunk(i, "", res.finish_reason)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def build_app(server: Server):
    """The FastAPI app of ``server``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="paratron", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    app.put("/api")(server.megatron)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.started,
                                            "owned_by": "paratron"}]}

    @app.get("/health")
    async def health():
        if not server.batcher.alive:
            raise ApiError(503, "the generation thread has stopped", retry_after=60)
        out = {"status": "ok", "model": server.name, "batches": server.batcher.batches, "queued": server.queued[0]}
        if server.engine is not None:
            out.update(server.engine.stats())
        else:
            out["kv_bytes_peak"] = server.model.engine.peak_cache_bytes
        return out
    return app


GRACE_SECONDS = 30  # on SIGTERM / SIGINT: how long requests in flight may take to finish


def _web_server(config):
    """A uvicorn server that, stopped by SIGTERM or SIGINT, finishes the requests in flight (at most
    GRACE_SECONDS) and returns, instead of re-raising the signal afterwards (uvicorn's default: the process
    then dies of it, exit 143). ``.stopped_by``: the signal's name, or None."""
    import signal

    import uvicorn

    class WebServer(uvicorn.Server):
        stopped_by: Optional[str] = None

        def handle_exit(self, sig, frame) -> None:
            if self.stopped_by is None:
                self.stopped_by = signal.Signals(sig).name
                print(f"paratron serve: {self.stopped_by} received; finishing the requests in flight "
                      f"(at most {GRACE_SECONDS} s)", flush=True)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean exit 0 once shut down, not death by the signal
    return WebServer(config)


def serve(model, host: str, port: int, max_batch: int, wait: float, name: str, continuous: bool = False,
          limits=None) -> None:
    """Run the server until SIGTERM or SIGINT (rank 0; the other ranks follow in runtime.Group.follow),
    then finish the requests in flight and return. ``limits``: the InferenceConfig (engine, queue limits)."""
    import uvicorn
    server = Server(model, max_batch, wait, name, continuous, limits)
    app = build_app(server)
    print(f"paratron serve: {name} on http://{host}:{port} (PUT /api, POST /v1/completions, "
          f"POST /v1/chat/completions, GET /v1/models, GET /health)", flush=True)
    # asyncio's loop, not uvloop even when installed: uvloop seldom releases the GIL, and the generation thread then
    # waits out Python's switch interval each step (docs/inference.md "The host cost of streaming")
    try:
        web = _web_server(uvicorn.Config(app, host=host, port=port, log_level="warning", loop="asyncio",
                                         timeout_graceful_shutdown=GRACE_SECONDS))
        web.run()
    finally:
        server.batcher.stop()
    if not web.started:  # (uvicorn logged why: the port in use, ...)
        raise SystemExit(3)
    print(f"paratron serve: shut down ({web.stopped_by or 'stopped'}) after {server.batcher.batches} batch(es)",
          flush=True)
