"""The server's host cost per streamed token, on CPU, without a model.

A stub engine (the paged engine's interface: check / add / step / result / idle / stats) behind the real
``PagedBatcher``, ``Server`` and streaming code, on uvicorn: each step sleeps --step-ms (a sleep releases the GIL,
as waiting for a GPU does) and then hands every running request one token through the batcher, as
``PagedEngine.step`` does. Token ids are read by a word-level tokenizer whose every token is "<id>" (as
serve_load.py's), so the server detokenizes, builds and writes each chunk as it would for a model.

--clients streams (``POST /v1/completions``, ``stream: true``) run at once from one client process (raw HTTP over
asyncio: parsing no JSON, so that the client costs little of the machine's CPU); each finished stream is replaced by
the next. Over the timed --seconds (after --warmup): streamed tokens/s and chunks/s (a chunk carries several tokens
when the server falls behind the engine), engine steps/s against the steps/s of the stub alone (what the GIL taken
by the event loop costs the engine thread), and the server process's CPU per streamed token and per chunk outside
the engine thread (the event loop: detokenizing, encoding, HTTP writes). --profile: cProfile of the event loop
over the timed window (top functions by own time).

    python benchmarks/serve_host.py                      # 256 streams, 3 ms steps
    python benchmarks/serve_host.py --step-ms 0 --profile
    python benchmarks/serve_host.py --http httptools --loop uvloop --record   # uvicorn's optional fast paths
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VOCAB = 32000


def word_tokenizer():
    """paratron's Hugging Face tokenizer over a word-level vocabulary "<0>".."<VOCAB-1>" (each token its own
    text, fused on decode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from paratron.data.tokenizers import _HFBased
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.Fuse()
    return _HFBased(tok, add_special_tokens=False)


class StubSeq:
    def __init__(self, req, owner, rng: random.Random):
        self.request, self.owner, self.done = req, owner, False
        self.generated: list = []
        self.script = [rng.randrange(1, VOCAB) for _ in range(req.params.max_new_tokens)]


class StubEngine:
    """The paged engine's interface: up to ``rows`` requests run, each step sleeps ``step_s`` then gives each one
    token (``on_token(seq, token)``), as PagedEngine.step does."""

    def __init__(self, detokenize, step_s: float, rows: int):
        self.detokenize, self.step_s, self.rows = detokenize, step_s, rows
        self.rng, self.waiting, self.running = random.Random(0), [], []
        self.steps = self.tokens = 0
        self.thread_id = None

    def warm_up(self) -> None:
        pass

    def startup_line(self) -> str:
        return f" stub engine: {self.step_s * 1e3:.1f} ms steps, {self.rows} rows"

    def check(self, req):
        return None

    def add(self, req, owner=None) -> StubSeq:
        seq = StubSeq(req, owner, self.rng)
        seq.done = not seq.script
        if not seq.done:
            self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def abort(self) -> None:
        self.waiting, self.running = [], []

    def step(self, on_token=None) -> list:
        self.thread_id = threading.get_ident()
        while self.waiting and len(self.running) < self.rows:
            self.running.append(self.waiting.pop(0))
        self.steps += 1
        if self.step_s > 0:
            time.sleep(self.step_s)
        finished = []
        for s in self.running:
            t = s.script[len(s.generated)]
            s.generated.append(t)
            if on_token is not None:
                on_token(s, t)
            if len(s.generated) == len(s.script):
                s.done = True
                finished.append(s)
        self.tokens += len(self.running)
        self.running = [s for s in self.running if not s.done]
        return finished

    def result(self, s: StubSeq):
        from paratron.inference.engine import Result
        return Result(list(s.request.prompt), list(s.generated), "length", self.detokenize(s.generated))

    def stats(self) -> dict:
        """Steps and tokens so far; the process's CPU seconds and the engine thread's (the rest: the event loop)."""
        engine_cpu = 0.0
        if self.thread_id is not None:
            engine_cpu = time.clock_gettime(time.pthread_getcpuclockid(self.thread_id))
        return {"steps": self.steps, "tokens": self.tokens, "cpu_s": time.process_time(), "engine_cpu_s": engine_cpu,
                "wall_s": time.perf_counter()}


class StubGroup:
    """What TextModel and Server take of runtime.Group: ``engine.check`` and ``paged(limits)``."""

    def __init__(self, engine: StubEngine):
        self.engine, self.stub = self, engine

    def check(self, req):
        return None

    def paged(self, limits) -> StubEngine:
        return self.stub


def profiled_app(app):
    """/bench/profile/start and /stop: cProfile of the event loop's thread between them (stop: the top functions)."""
    import cProfile
    import io
    import pstats

    from fastapi.responses import PlainTextResponse
    held = {}

    @app.get("/bench/profile/start")
    async def start():
        held["p"] = cProfile.Profile()
        held["p"].enable()
        return {"ok": True}

    @app.get("/bench/profile/stop")
    async def stop(top: int = 30):
        p = held.pop("p")
        p.disable()
        out = io.StringIO()
        pstats.Stats(p, stream=out).sort_stats("tottime").print_stats(top)
        return PlainTextResponse(out.getvalue())
    return app


def run_server(port: int, step_ms: float, rows: int, loop: str, http: str, switch_ms: float) -> None:
    """The stub engine behind the real Server on uvicorn (a process of its own)."""
    import uvicorn
    if switch_ms:
        sys.setswitchinterval(switch_ms / 1e3)

    from paratron.config.inference import InferenceConfig
    from paratron.inference.server import Server, build_app
    from paratron.inference.text import TextModel
    tok = word_tokenizer()
    model = TextModel(StubGroup(StubEngine(tok.detokenize, step_ms / 1e3, rows)), tok, "stub")
    server = Server(model, rows, 0.0, "stub", limits=InferenceConfig(inference_dynamic_batching=True))
    app = profiled_app(build_app(server))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http)


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read(-1)
    writer.close()
    return data.split(b"\r\n\r\n", 1)[1]


async def stream_once(port: int, body: bytes, tally: dict) -> None:
    """One streamed completion; its tokens ("<" in the stream) and chunks ("data: ") counted as they come."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        tally["tokens"] += data.count(b"<")
        tally["chunks"] += data.count(b"data: ")
        tail = (tail + data)[-64:]
    writer.close()
    if b"[DONE]" not in tail:
        raise RuntimeError(f"a stream ended without [DONE]: {tail!r}")


async def drive(port: int, clients: int, new: tuple, warmup: float, seconds: float) -> dict:
    """``clients`` streams at once, each replaced when done; the counts over the timed window and the server's
    stats (the stub engine's, via /health) at its two ends."""
    tally, rng, stop = {"tokens": 0, "chunks": 0}, random.Random(1), []

    async def client():
        while not stop:
            prompt = [rng.randrange(1, VOCAB) for _ in range(8)]
            body = json.dumps({"model": "stub", "prompt": prompt, "max_tokens": rng.randint(*new),
                               "temperature": 0, "stream": True}).encode()
            await stream_once(port, body, tally)
    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    await asyncio.sleep(warmup)
    marks = [dict(tally), json.loads(await get(port, "/health"))]
    await asyncio.sleep(seconds)
    marks += [dict(tally), json.loads(await get(port, "/health"))]
    stop.append(True)
    await asyncio.gather(*tasks)
    return {"client": (marks[0], marks[2]), "server": (marks[1], marks[3])}


async def profile_window(port: int, clients: int, new: tuple, warmup: float, seconds: float) -> tuple:
    async def bracket():
        await asyncio.sleep(warmup)
        await get(port, "/bench/profile/start")
        await asyncio.sleep(seconds)
        return (await get(port, "/bench/profile/stop")).decode()
    return await asyncio.gather(drive(port, clients, new, warmup, seconds), bracket())


def stub_alone(step_ms: float, rows: int, steps: int = 200) -> float:
    """Steps/s of the stub engine with nothing else in the process (the ceiling the server's engine thread has)."""
    from paratron.inference.engine import Request
    from paratron.inference.sampling import SamplingParams
    engine = StubEngine(lambda ids: "", step_ms / 1e3, rows)
    for _ in range(rows):
        engine.add(Request([1], SamplingParams(steps)))
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(lambda seq, tok: None)
    return steps / (time.perf_counter() - start)


def figures(run: dict, args, alone: float) -> dict:
    (c0, c1), (s0, s1) = run["client"], run["server"]
    wall = s1["wall_s"] - s0["wall_s"]
    tokens, chunks = c1["tokens"] - c0["tokens"], c1["chunks"] - c0["chunks"]
    steps = s1["steps"] - s0["steps"]
    loop_cpu = (s1["cpu_s"] - s0["cpu_s"]) - (s1["engine_cpu_s"] - s0["engine_cpu_s"])
    return {"tokens_per_s": round(tokens / wall), "chunks_per_s": round(chunks / wall),
            "engine_tokens_per_s": round((s1["tokens"] - s0["tokens"]) / wall),
            "steps_per_s": round(steps / wall, 1), "stub_alone_steps_per_s": round(alone, 1),
            "step_interval_ms": round(1e3 * wall / max(steps, 1), 3),
            "loop_cpu_us_per_token": round(1e6 * loop_cpu / max(tokens, 1), 2),
            "loop_cpu_us_per_chunk": round(1e6 * loop_cpu / max(chunks, 1), 2),
            "engine_cpu_us_per_step": round(1e6 * (s1["engine_cpu_s"] - s0["engine_cpu_s"]) / max(steps, 1), 1),
            "loop_cpu_share": round(loop_cpu / wall, 3)}


def measure(args) -> tuple[dict, str]:
    from tests.dist import free_port
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_server, daemon=True,
                       args=(port, args.step_ms, args.rows, args.loop, args.http, args.switch_ms))
    proc.start()
    try:
        deadline = time.time() + 120
        while True:
            try:
                asyncio.run(get(port, "/health"))
                break
            except OSError:
                if not proc.is_alive() or time.time() > deadline:
                    raise SystemExit("the stub server did not start")
                time.sleep(0.2)
        new = (args.new_min, args.new_max)
        if args.profile:
            run, prof = asyncio.run(profile_window(port, args.clients, new, args.warmup, args.seconds))
        else:
            run, prof = asyncio.run(drive(port, args.clients, new, args.warmup, args.seconds)), ""
    finally:
        proc.terminate()
        proc.join(10)
    return figures(run, args, stub_alone(args.step_ms, args.rows)), prof


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=256, help="streams at once")
    ap.add_argument("--rows", type=int, default=256, help="the stub engine's most running requests")
    ap.add_argument("--step-ms", type=float, default=3.0, help="the stub's step: a sleep (0: tokens at once)")
    ap.add_argument("--new-min", type=int, default=64)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"], help="uvicorn's event loop")
    ap.add_argument("--http", default="h11", choices=["h11", "httptools"], help="uvicorn's HTTP parser")
    ap.add_argument("--switch-ms", type=float, default=0.0, help="the server's GIL switch interval (0: Python's)")
    ap.add_argument("--profile", action="store_true", help="cProfile the event loop over the timed window")
    ap.add_argument("--record", action="store_true", help="write a record to $OUT, else benchmarks/results/")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    out, prof = measure(args)
    print(json.dumps(out), flush=True)
    if prof:
        print(prof)
    if args.record:
        from record import write_record
        rows = "\n".join(f"| {k} | {v} |" for k, v in out.items())
        write_record(os.environ.get("OUT") or ROOT / "benchmarks" / "results", "serve_host",
                     "Server host cost per streamed token (stub engine, CPU)", f"CPU ({os.cpu_count()} cores)",
                     {"clients": args.clients, "step": f"{args.step_ms} ms", "uvicorn": f"{args.loop} + {args.http}"},
                     "| figure | value |\n|---|---|\n" + rows)


if __name__ == "__main__":
    main()
