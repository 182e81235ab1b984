"""Serving under load: N requests with Poisson arrivals through ``paratron serve`` (the openai client, streaming),
and the same load through transformers' continuous batching.

The load (seeded, shipped with the script): request i arrives at the sum of i exponential gaps of mean
1 / --rate seconds (--rate 0: all at once); its prompt is uniform random token ids, its length uniform in
[--prompt-min, --prompt-max], after --shared-prefix tokens common to all; its output length uniform in [--new-min, --new-max], greedy, no end-of-document
stop (the tokenizer has none), so each request runs to its own length. The model: random weights of the llama-1b
shape (bf16 on a GPU) or, with --tiny, a 2-layer model on CPU (a smoke test of the script, not a figure), saved as
a Hugging Face directory with a word-level tokenizer that gives every token id its own text ("<id>"), so each
streamed chunk is one token.

Engines (--engines, comma-separated): ``offline`` (the paged engine in this process with --serve-flags: every
request at once with --rate 0, the in-process peer of transformers' manager; else each request added between two
steps once it has arrived, its TTFT and inter-token latency taken when its tokens reach the host: the engine's
own latencies, without HTTP), ``paged`` (--inference-dynamic-batching, with
--serve-flags), ``fixed``
(today's fixed-batch server), ``continuous`` (--continuous-batching), ``hf`` (transformers' generate_batch
manager in this process: requests added at their arrival times; it hands back whole results, so TTFT and
inter-token latency are not measured for it, only output tokens/s and end-to-end latency). Per engine: output
tokens/s over the run (first arrival to last token), TTFT and inter-token latency p50 / p99 (between
streamed chunks: one token each unless the server fell behind and joined a few), end-to-end latency
p50 / p99, peak KV-cache bytes (the server's /health). One JSON line per engine, then a Markdown table.

    python benchmarks/serve_load.py --tiny                    # CPU smoke test
    python benchmarks/serve_load.py --requests 256 --rate 20 --engines paged,fixed,hf
    python benchmarks/serve_load.py --requests 256 --rate 0 --engines offline --profile   # kernels per step
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# the llama-1b shape of ../shared/bench/hf_generate.py and hf_cb.py (the peers' runs)
LLAMA_1B = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32768, max_position_embeddings=4096, rope_theta=500000.0,
                tie_word_embeddings=False)
TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=128)


def load(args) -> list[tuple[float, list, int]]:
    """(arrival s, prompt ids, new tokens) of every request."""
    rng, at, out = random.Random(args.seed), 0.0, []
    vocab = (TINY if args.tiny else LLAMA_1B)["vocab_size"]
    shared = [rng.randrange(1, vocab) for _ in range(args.shared_prefix)]
    for _ in range(args.requests):
        prompt = shared + [rng.randrange(1, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        out.append((at, prompt, rng.randint(args.new_min, args.new_max)))
        at += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    return out


def model_dir(args, d: Path) -> Path:
    """Random weights of the shape, saved as a Hugging Face directory with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    shape = TINY if args.tiny else LLAMA_1B
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, eos_token_id=None, bos_token_id=None))
    model.to(torch.float32 if args.tiny else torch.bfloat16).save_pretrained(d)
    vocab = {f"<{i}>": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.Fuse()
    tok.save(str(d / "tokenizer.json"))
    return d


def percentiles(xs: list) -> tuple:
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else None  # noqa: E731
    return pick(0.5), pick(0.99)


def tokens_in(text: str) -> int:
    """Tokens in a streamed text of model_dir's tokenizer, whose every token reads "<id>"."""
    return text.count("<")


async def drive(url: str, reqs: list, t0: float, model: str = "m", count=tokens_in) -> list:
    """Each request at its arrival time after ``t0`` (time.time()) through the openai client (streaming):
    (sent, [time of each streamed text chunk], tokens streamed (``count`` of each chunk's text)) per request."""
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)

    async def one(at, prompt, n):
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        sent, stamps, tokens = time.time(), [], 0
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.time())
                tokens += count(chunk.choices[0].text)
        return sent, stamps, tokens
    async with client:  # (closed after: the server's shutdown waits for open connections)
        return await asyncio.gather(*(one(*r) for r in reqs))


def _client(url: str, reqs: list, t0: float, model: str = "m", count=tokens_in) -> list:
    return asyncio.run(drive(url, reqs, t0, model, count))


def drive_all(url: str, reqs: list, clients: int, model: str = "m", count=tokens_in) -> dict:
    """The load from ``clients`` processes (request i from process i mod clients), all timed from one start: one
    Python client parses a few thousand streamed chunks a second, fewer than a fast server sends; the timings."""
    t0 = time.time() + (2.0 if clients > 1 else 0.0)  # (the processes start before the first arrival)
    if clients == 1:
        done = _client(url, reqs, t0, model, count)
    else:
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = pool.map(_client, [url] * clients, [reqs[i::clients] for i in range(clients)], [t0] * clients,
                             [model] * clients, [count] * clients)
            done = [r for part in parts for r in part]
    end = max(s[-1] for _, s, _ in done if s)
    # (a chunk holds the tokens of the steps that queued while the server sent the last one: ITL is between chunks)
    return {"output_tokens": sum(n for _, _, n in done), "wall_s": end - t0,
            "ttft": [s[0] - sent for sent, s, _ in done if s], "e2e": [s[-1] - sent for sent, s, _ in done if s],
            "itl": [b - a for _, s, _ in done for a, b in zip(s, s[1:])]}


def serve(args, d: Path, engine: str, reqs: list) -> dict:
    """``paratron serve`` with the engine's flags, the load through it, its /health."""
    from tests.dist import free_port
    port = free_port()
    flags = {"paged": ["--inference-dynamic-batching", *args.serve_flags.split()], "fixed": [],
             "continuous": ["--continuous-batching"]}[engine]
    if not args.tiny:
        flags += ["--torch-compile"]
    launch = [sys.executable] if args.nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node", str(args.nproc)]
    proc = subprocess.Popen([*launch, "-m", "paratron", "serve", "--load", str(d), "--port", str(port),
                             "--model-name", "m", "--max-batch-size", str(args.max_batch), *flags],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"serve_load: the {engine} server exited with {proc.returncode}")
                time.sleep(0.5)
        drive_all(url, reqs[:min(4, len(reqs))], 1)  # warm-up (compilation, graphs)
        out = drive_all(url, reqs, args.clients)
        with urllib.request.urlopen(url + "/health") as r:
            health = json.loads(r.read())
        out["kv_bytes_peak"], out["note"] = health.get("kv_bytes_peak"), compile_note(health).lstrip("; ")
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def offline(args, d: Path, reqs: list) -> dict:
    """The paged engine in this process (``paratron generate --inference-dynamic-batching``'s path, the server's
    flags), every request given at once: the offline case, as transformers' manager runs in-process."""
    from paratron.config import inference
    from paratron.inference.cli import generate_parser, open_model
    from paratron.inference.engine import Request
    from paratron.inference.sampling import SamplingParams
    flags = ["--load", str(d), "--inference-dynamic-batching", *args.serve_flags.split()]
    cli = generate_parser().parse_args(flags + ([] if args.tiny else ["--torch-compile"]))
    model, _ = open_model(cli)
    engine = model.group.paged(inference.from_args(cli))
    requests = [Request(list(prompt), SamplingParams(max_new_tokens=n, ignore_eod=True)) for _, prompt, n in reqs]
    engine.warm_up()  # every decode bucket's graph, as the server does at start-up
    engine.generate(requests[:min(4, len(requests))])  # warm-up of the prefill path
    engine.reset_stats()  # the timed run's steps, peak KV blocks and prefix-cache hits only
    if args.rate > 0:
        out = arrivals(engine, [at for at, _, _ in reqs], requests)
        how = "in-process, requests added between steps at their arrival times (no HTTP); "
    else:
        first: dict = {}

        def on_token(seq, token):
            first.setdefault(seq.id, time.perf_counter())
        t0 = time.perf_counter()
        results = engine.generate(requests, on_token)
        out = {"output_tokens": sum(len(r.tokens) for r in results), "wall_s": time.perf_counter() - t0,
               "ttft": [t - t0 for t in first.values()], "itl": [], "e2e": []}
        how = "in-process, all requests at once; "
    stats = engine.stats()  # the timed run's (before a profiled run adds its own steps)
    if args.profile:  # the same load again under the profiler (at its arrival times): where the device's time goes
        few = reqs[:12] if args.rate > 0 else reqs  # (arrivals: the first 12, a trace of their steps' host work)
        again = [Request(list(prompt), SamplingParams(max_new_tokens=n, ignore_eod=True)) for _, prompt, n in few]
        profile_run(engine, lambda: arrivals(engine, [at for at, _, _ in few], again) if args.rate > 0
                    else engine.generate(again))
    return {**out, "kv_bytes_peak": stats.get("kv_bytes_peak"), "note": how +
            "per step: {step_ms_mean} ms, {device_wait_ms_mean} ms of it waiting for the device's tokens; "
            "{decode_steps} steps of decodes only, {decode_step_ms_mean} ms each; the others {mixed_step_ms_mean} ms "
            "each ({mixed_wait_ms_mean} ms of it waiting for the device); prefix-cache hit blocks "
            "{prefix_cache_hit_blocks}".format(**stats) + compile_note(stats)}


def compile_note(stats: dict) -> str:
    """The engine's compiled graphs and frames left uncompiled (their steps ran eager), when it compiles."""
    if "compiled_graphs" not in stats:
        return ""
    return "; compiled graphs {compiled_graphs}, frames not compiled {frames_not_compiled}".format(**stats)


def arrivals(engine, times: list, requests: list) -> dict:
    """The requests added to the engine between its steps once their arrival times (seconds after the start) have
    passed; TTFT from arrival to the step that gave the first token back to the host, inter-token latency
    between the steps that gave a request's consecutive tokens (the engine's own latency, without HTTP)."""
    stamps: dict = {}

    def on_token(seq, token):
        if token is not None:
            stamps[seq.id].append(time.perf_counter())
    order = sorted(range(len(requests)), key=lambda i: times[i])
    sent, done, t0 = {}, 0, time.perf_counter()
    while order or not engine.idle:
        now = time.perf_counter()
        while order and t0 + times[order[0]] <= now:
            i = order.pop(0)
            seq = engine.add(requests[i])
            sent[seq.id], stamps[seq.id] = t0 + times[i], []
        if engine.idle:
            time.sleep(max(0.0, t0 + times[order[0]] - time.perf_counter()))
            continue
        done += len(engine.step(on_token))
    assert done == len(requests), f"{done} of {len(requests)} requests finished"
    got = [(sent[k], s) for k, s in stamps.items() if s]
    return {"output_tokens": sum(len(s) for _, s in got), "wall_s": max(s[-1] for _, s in got) - t0,
            "ttft": [s[0] - at for at, s in got], "e2e": [s[-1] - at for at, s in got],
            "itl": [b - a for _, s in got for a, b in zip(s, s[1:])]}


def profile_run(engine, load: Callable, top: int = 25) -> None:
    """``--profile``: the offline load once more (``load``) under torch.profiler; GPU time by kind of kernel, the top
    kernels with their launches per step, the time the GPU had no kernel running (profile_step.py's reading of the
    trace), and the host's time per step in paratron's Python functions (where a step's host work goes)."""
    import torch
    from profile_step import idle_by_neighbours, tally, trace_kernels
    if not torch.cuda.is_available():
        raise SystemExit("serve_load: --profile reads the GPU's kernels: run it on a GPU")
    steps = engine.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        load()
        torch.cuda.synchronize()
    steps = engine.steps - steps
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        kernels = trace_kernels(Path(tmp) / "trace.json")
        python = python_time(Path(tmp) / "trace.json")
    by_name, count, kinds = tally(kernels)
    span = kernels[-1][1] - kernels[0][0]
    _, idle = idle_by_neighbours(kernels)
    print(f"profile: {steps} steps, span {span / 1000:.1f} ms, GPU idle {idle / 1000:.1f} ms; per step:")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v / steps / 1000:8.3f} ms")
    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {v / steps / 1000:8.3f} ms {count[k] / steps:6.1f}x  {k[:120]}")
    print("host: Python functions of paratron by their time per step (calls included; the engine's step first)")
    for name, us in sorted(python.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps / 1000:8.3f} ms  {name[:120]}")
    print("host: operators and CUDA calls by their own CPU time (the whole run)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def python_time(path) -> dict:
    """{paratron function (file:line(name)): microseconds inside it, the calls it makes included} of the Python
    function events of a trace recorded with ``with_stack=True``; a function that calls itself counts once."""
    import json
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans: dict = {}
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e and "paratron/" in e["name"]:
            spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    total = {}
    for name, got in spans.items():
        got.sort()
        us, end = 0.0, float("-inf")
        for a, b in got:  # the union of its spans: recursion and nesting counted once
            if b > end:
                us += b - max(a, end)
                end = b
        total[name] = us
    return total


def hf(args, d: Path, reqs: list) -> dict:
    """transformers' continuous batching manager, requests added at their arrival times."""
    import torch
    import transformers
    from transformers import GenerationConfig
    dev = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model = transformers.AutoModelForCausalLM.from_pretrained(d).to(dev).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        manager = model.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=args.new_max, **kw))
        manager.start()
        got, t0 = {}, time.perf_counter()

        def collect():
            while len(got) < len(reqs):
                res = manager.get_result(timeout=3600)
                got[res.request_id] = (time.perf_counter(), len(res.generated_tokens))
        reader = threading.Thread(target=collect)
        reader.start()
        sent = []
        for i, (at, prompt, n) in enumerate(reqs):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent.append(time.perf_counter())
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        reader.join()
        manager.stop(block=True)
    end = max(t for t, _ in got.values())
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    return {"output_tokens": sum(n for _, n in got.values()), "wall_s": end - t0, "ttft": [], "itl": [],
            "e2e": [got[f"r{i}"][0] - s for i, s in enumerate(sent)], "kv_bytes_peak": peak,
            "note": f"transformers {transformers.__version__}; peak bytes: all CUDA memory (weights included)"}


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--requests", type=int, default=256)
    a.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second (0: all at once)")
    a.add_argument("--prompt-min", type=int, default=64)
    a.add_argument("--prompt-max", type=int, default=512)
    a.add_argument("--new-min", type=int, default=64)
    a.add_argument("--new-max", type=int, default=256)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (prefix caching)")
    a.add_argument("--engines", default="paged,fixed,hf")
    a.add_argument("--max-batch", type=int, default=32, help="--max-batch-size of the fixed-batch servers")
    a.add_argument("--serve-flags", default="--enable-chunked-prefill --inference-dynamic-batching-block-size 64 "
                                            "--inference-dynamic-batching-max-tokens 8192",
                   help="the paged server's flags")
    a.add_argument("--nproc", type=int, default=1,
                   help="paratron's servers under torchrun on this many processes (tensor parallelism)")
    a.add_argument("--clients", type=int, default=1, help="client processes driving the load (one Python client "
                   "parses a few thousand streamed chunks a second)")
    a.add_argument("--profile", action="store_true", help="offline: the load once more under the profiler (GPU)")
    a.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU, few short requests (smoke test)")
    args = a.parse_args(argv)
    if args.tiny:
        args.requests, args.prompt_min, args.prompt_max, args.new_min, args.new_max = 12, 2, 20, 2, 8
        args.serve_flags = "--enable-chunked-prefill --inference-dynamic-batching-block-size 4 " \
                           "--inference-dynamic-batching-max-tokens 32 --inference-dynamic-batching-num-blocks 200"
    reqs = load(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = model_dir(args, Path(tmp))
        for engine in args.engines.split(","):
            r = hf(args, d, reqs) if engine == "hf" else offline(args, d, reqs) if engine == "offline" else \
                serve(args, d, engine, reqs)
            row = {"engine": engine, "requests": len(reqs), "rate": args.rate,
                   "output_tokens_per_s": round(r["output_tokens"] / r["wall_s"], 1), "output_tokens": r["output_tokens"],
                   "ttft_ms_p50_p99": percentiles(r["ttft"]), "itl_ms_p50_p99": percentiles(r["itl"]),
                   "e2e_ms_p50_p99": percentiles(r["e2e"]), "kv_bytes_peak": r.get("kv_bytes_peak"),
                   "note": r.get("note", "")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = ["| engine | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 ms | peak KV bytes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['engine']} | {r['output_tokens_per_s']} | {r['ttft_ms_p50_p99']} | {r['itl_ms_p50_p99']} | "
                     f"{r['e2e_ms_p50_p99']} | {r['kv_bytes_peak']} |")
    print("\n" + "\n".join(table))
    if not args.tiny:  # a figure: the dated record (the smoke test writes none)
        import torch
        from record import write_record
        hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        facts = {"load": f"{args.requests} requests, Poisson rate {args.rate}/s, prompts {args.shared_prefix} shared + "
                         f"U[{args.prompt_min}, {args.prompt_max}], outputs U[{args.new_min}, {args.new_max}], "
                         f"seed {args.seed}",
                 "paged flags": args.serve_flags}
        write_record(os.environ.get("OUT") or ROOT / "benchmarks" / "results", "serve_load", "Serving under load",
                     hardware, facts, "\n".join(table) + "\n\n" + "\n".join(json.dumps(r) for r in rows))


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    main()
