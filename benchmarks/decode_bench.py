"""Generation speed: decode tokens/s at batch 1 and 32 and time to first token, paratron beside HF
transformers ``generate`` (static cache + torch.compile), same weights, same process.

    python benchmarks/decode_bench.py                      # llama-1b shape, random bf16 weights, one GPU
    python benchmarks/decode_bench.py --tiny               # a tiny model on the CPU (checks the script)
    python benchmarks/decode_bench.py --load CKPT --num-speculative-tokens 1 --num-speculative-tokens 2

With ``--num-speculative-tokens K`` (repeatable) it measures speculative decoding from MTP depths instead: plain
decoding beside speculative decoding with each K, at ``--batch`` (default 1), on ``--load`` (a checkpoint trained
with ``--mtp-num-layers N >= K``; ``--tiny``: a random tiny model with 2 depths). Prompts: ``--prompt-kind
counting`` (default there) continues (s, s + 1, ...) mod vocab, the documents of ``--mock-data``; ``random``
draws token ids. Each speculative row records its acceptance (accepted / drafted over the timed generation),
tokens kept per verification pass, and whether its tokens equal plain decoding's (greedy: they must, up to bf16
near-ties).
    python benchmarks/decode_bench.py --config hybrid-mini --family nemotron_h   # a hybrid stack
    python benchmarks/decode_bench.py --family qwen3       # llama-1b's shape with Qwen3's query / key norms
    python benchmarks/decode_bench.py --family qwen2       # llama-1b's shape with Qwen2's qkv bias

Both systems run greedy with the same random weights (the paratron model converted to HF with
``paratron_to_hf``) and never stop early (no end-of-document token). Per batch size: time to first
token = wall time of a generation of one token (prefill and one sampling step, tokens on the host); decode
tokens/s = batch x (N - 1) / (time of a generation of N tokens - time to first token), as ../shared/bench's
hf_generate.py measures it: nothing reads the tokens while they are generated (a per-token callback would
make paratron's engine read each token back, a host synchronisation per step). Each time is the median of
``--repeats`` runs after warm-up runs (compilation, CUDA graph capture); the time of the whole generation of N
tokens is given too (a prompt's prefill is launched from Python, so its time follows the host's load, and the decode
rate inherits that noise; the whole generation's time does not depend on the subtraction). paratron runs its engine
with ``compile=True`` (torch.compile'd decode step replayed as a CUDA graph) unless ``--no-compile``; HF runs
``cache_implementation="static"``, compiled on GPU as transformers does it itself (``--hf-compile``); a hybrid
family (``--family nemotron_h``) runs ``generate`` with its own cache, eager.
Prints a table and JSON lines, and writes a record (record.py) with the JSON rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from record import write_record  # noqa: E402  (benchmarks/record.py)
from paratron.config.kernels import CHOICES  # noqa: E402


# the transformer families beside paratron (a static cache in transformers), each with its layers' flags
LAYER_FLAGS = {"llama": [], "qwen2": ["--add-qkv-bias"], "qwen3": ["--qk-layernorm"]}


def build(tiny: bool, device, dtype, preset: str = "llama-1b", family: str = "llama", gemv: Optional[str] = None,
          attention: Optional[str] = None, extra: tuple = ()):
    """(paratron GPTModel, the Hugging Face model of ``family``, real vocabulary) with the same random weights;
    ``gemv`` / ``attention``: paratron's --kernel-decode-gemv / --kernel-decode-attention (None: the default);
    ``extra``: more paratron flags of the model (``--model-args``)."""
    import transformers

    from paratron.checkpoint.hf import paratron_to_hf
    from paratron.checkpoint.hf_config import hf_config_from_model_config
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    if tiny and family in LAYER_FLAGS:
        args = ["--config", "tiny", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights", "--init-method-std", "0.3"]  # sharp: no greedy near-ties
    elif tiny:  # a tiny hybrid stack (nemotron_h)
        args = ["--config", "tiny", "--hybrid-layer-pattern", "M*-M", "--normalization", "RMSNorm",
                "--squared-relu", "--position-embedding-type", "none", "--disable-bias-linear", "--mamba-state-dim",
                "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2", "--untie-embeddings-and-output-weights",
                "--init-method-std", "0.3"]
    else:
        args = ["--config", preset]
    args += LAYER_FLAGS.get(family, [])
    args += ["--kernel-decode-gemv", gemv] if gemv else []
    args += ["--kernel-decode-attention", attention] if attention else []
    args += list(extra)
    cfg = parse_args(args + ["--mock-data"] if "--mock-data" not in args else args)
    m, vocab = cfg.model, cfg.data.vocab_size
    torch.manual_seed(0)
    kernels = cfg.kernels if gemv or attention or extra else None
    model = GPTModel(m, cfg.padded_vocab_size, kernels=kernels, device=device, dtype=dtype).eval()
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    hf_cfg = hf_config_from_model_config(m, vocab, family)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "torch_dtype"})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(_in_memory_names(paratron_to_hf(state, m, family, vocab), family), strict=False)
    hf = hf.to(device=device, dtype=dtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return model, hf, vocab, m


def build_mtp(args, device, dtype):
    """(model, real vocabulary, name)."""
    if args.load:
        from paratron.inference.load import load_for_inference
        loaded = load_for_inference(args.load, device=device, dtype={torch.bfloat16: "bf16"}.get(dtype, "fp32"))
        return loaded.model, loaded.vocab_size, Path(args.load).name
    from paratron.config import parse_args
    from paratron.model.gpt import GPTModel
    cfg = parse_args(["--config", "tiny", "--mock-data", "--normalization", "RMSNorm", "--swiglu",
                      "--position-embedding-type", "rope", "--mtp-num-layers", "2", "--init-method-std", "0.3"])
    torch.manual_seed(0)
    model = GPTModel(cfg.model, cfg.padded_vocab_size, device=device, dtype=dtype).eval()
    return model, cfg.data.vocab_size, "tiny"


def spec_runner(model, vocab: int, compile_: bool, k: int):
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    engine = Engine(model, vocab, eod=None, compile=compile_, num_speculative_tokens=k)

    def run(prompts: torch.Tensor, n: int):
        return [r.tokens for r in engine.generate([Request(p, SamplingParams(n)) for p in prompts.tolist()])]
    return engine, run


def prompts_of(kind: str, batch: int, length: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        return torch.randint(0, vocab, (batch, length), generator=g).to(device)
    starts = torch.randint(1, vocab, (batch, 1), generator=g)
    return ((starts + torch.arange(length)[None]) % vocab).to(device)


def speculative_main(args, device, dtype, compile_: bool) -> int:
    """Plain decoding beside speculative decoding with each --num-speculative-tokens K (module docstring)."""
    plen, n = args.prompt_len or (8 if args.tiny else 128), args.new_tokens or (8 if args.tiny else 256)
    model, vocab, name = build_mtp(args, device, dtype)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    args.batch = args.batch[0] if args.batch else 1  # one batch size (the first given)
    print(f"torch {torch.__version__} on {hardware}; {name}, batch {args.batch}, {args.prompt_kind} prompts of "
          f"{plen}, {n} new tokens, compile {compile_}", flush=True)
    prompts = prompts_of(args.prompt_kind, args.batch, plen, vocab, device)
    rows, plain_tokens = [], None
    for k in [0] + (args.num_speculative_tokens or [1, 2]):
        engine, run = spec_runner(model, vocab, compile_, k)
        row = dict(system="plain" if k == 0 else f"speculative k={k}", batch=args.batch,
                   **measure(run, prompts, n, args.repeats, args.warmup, device))
        tokens = run(prompts, n)
        if k == 0:
            plain_tokens = tokens
        else:
            s = engine.acceptance
            same = sum(x == y for a, b in zip(tokens, plain_tokens) for x, y in zip(a, b))
            row.update(acceptance=round(s.rate, 4), tokens_per_pass=round(s.tokens_per_step, 3),
                       same_tokens_as_plain=round(same / max(sum(map(len, plain_tokens)), 1), 3),
                       first_difference=next((i for i, (x, y) in enumerate(zip(tokens[0], plain_tokens[0])) if x != y),
                                             None),  # row 0's first position unlike plain decoding (None: equal)
                       passes_ahead=s.ahead,  # passes whose counts stayed on the device (read once per chunk)
                       speedup=round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return spec_report(rows, args, name, hardware, plen, n, compile_)


def spec_report(rows, args, name, hardware, plen, n, compile_) -> int:
    lines = ["| system | batch | decode tokens/s | speedup | acceptance | tokens per pass | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['batch']} | {r['decode_tok_s']} | {r.get('speedup', '')} | "
                     f"{r.get('acceptance', '')} | {r.get('tokens_per_pass', '')} | "
                     f"{r.get('same_tokens_as_plain', '')} |")
    return write(args, rows, lines, f"decode_bench_speculative_{name}", f"Speculative decoding: {name}", hardware,
                 f"batch {args.batch}, {args.prompt_kind} prompts of {plen} tokens, {n} new tokens, greedy", compile_)


def write(args, rows, lines, stem, title, hardware, shape, compile_, paths: str = "") -> int:
    """Print the table ``lines`` and write the record with the rows as JSON lines (``paths``: what paratron's
    one-row steps ran, ``paths_of``)."""
    table = "\n".join(lines)
    print("\n" + table)
    body = table + "\n\n```json\n" + "\n".join(json.dumps(r) for r in rows) + "\n```\n"
    write_record(args.record_dir, stem, title, hardware,
                 {"shape": shape,
                  "method": f"median of {args.repeats} after {args.warmup} warm-up runs; compile {compile_}",
                  **({"paratron's one-row steps": paths} if paths else {})},
                 body)
    return 0


def streamed_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, less the input embedding table (a step reads only
    its rows), unless the output layer reads that table (tied embeddings). The KV cache's reads are not counted
    (at these lengths under 1 % of the weights')."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embedding.word_embeddings.weight
    tied = model.output_layer.weight is None
    return total if tied else total - table.numel() * table.element_size()


def hbm_gbps(hardware: str) -> Optional[float]:
    """The HBM bandwidth (GB/s) of the SXM parts paratron's planner knows, by the device's name (None otherwise:
    PCIe and NVL parts differ)."""
    from paratron.plan.traffic import HBM_GBPS
    name = hardware.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    if "A100" in name:
        return HBM_GBPS["a100-40gb" if "40GB" in name else "a100"]
    return next((HBM_GBPS[k] for k in ("h100", "h200") if k.upper() in name), None)


def bandwidth(rows: list, weight_bytes: int, hardware: str) -> None:
    """Adds to each paratron row the weights' bytes a step reads (GB) and the rate they stream at (TB/s: bytes x
    steps per second, a step decoding one token of each of the batch's rows), and the share of the GPU's HBM
    bandwidth where its kind is known (NVIDIA's datasheets: paratron/plan/traffic.py)."""
    peak = hbm_gbps(hardware)
    for r in rows:
        if r["system"] != "paratron":
            continue
        rate = weight_bytes * r["decode_tok_s"] / r["batch"] / 1e12
        r.update(weights_gb=round(weight_bytes / 1e9, 3), weights_tb_s=round(rate, 2))
        if peak:
            r["hbm_share"] = round(1e3 * rate / peak, 3)


def paths_of(engine) -> str:
    """What the engine's one-row decode steps run: layers as row GEMVs, layers with the fused attention, and the
    decode switches as the engine resolved them."""
    layers = [m for m in engine.model.modules() if hasattr(m, "decode_rows")]
    fused = sum(bool(getattr(getattr(m, "self_attention", None), "fused_decode", False)) for m in layers)
    return (f"layers the row path takes: {sum(bool(m.decode_rows) for m in layers)} of {len(layers)} (the fused "
            f"attention: {fused}); through the GEMV kernels: {'yes' if engine.gemv_at(1) else 'no'} "
            f"(--kernel-decode-gemv {engine.gemv}, --kernel-decode-pdl {engine.decode_pdl()})")


def _in_memory_names(state: dict, family: str) -> dict:
    """NemotronH's files name its modules backbone.*, its in-memory model model.*."""
    if family != "nemotron_h":
        return state
    return {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in state.items()}


def paratron_runner(model, vocab, compile_: bool):
    from paratron.inference.engine import Engine, Request
    from paratron.inference.sampling import SamplingParams
    engine = Engine(model, vocab, eod=None, compile=compile_)

    def run(prompts: torch.Tensor, n: int):
        reqs = [Request(p, SamplingParams(n)) for p in prompts.tolist()]
        return [r.tokens for r in engine.generate(reqs)]
    run.engine = engine  # (paths_of reads it)
    return run


def hf_runner(hf, compile_: str, static: bool = True):
    """``compile_``: "auto" (transformers compiles the forward itself when generating with a static cache
    on a GPU: its default CompileConfig, fullgraph + reduce-overhead), "manual" (the older recipe:
    ``model.forward = torch.compile(..., mode="reduce-overhead", fullgraph=True)``), or "off"."""
    hf.generation_config.disable_compile = compile_ != "auto"
    if compile_ == "manual":
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)

    def run(prompts: torch.Tensor, n: int):
        with torch.no_grad():
            out = hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                              **({"cache_implementation": "static"} if static else {}))
        return out[:, prompts.shape[1]:].tolist()
    return run


def timed(run, prompts, n: int, device) -> float:
    """Seconds of one generation of ``n`` tokens per prompt."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(prompts, n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(run, prompts, n: int, repeats: int, warmup: int, device) -> dict:
    for _ in range(warmup):
        timed(run, prompts, 1, device), timed(run, prompts, n, device)
    first = statistics.median(timed(run, prompts, 1, device) for _ in range(repeats))
    total = statistics.median(timed(run, prompts, n, device) for _ in range(repeats))
    rest, b = max(total - first, 1e-9), prompts.shape[0]
    return {"ttft_ms": round(1000 * first, 2), "decode_tok_s": round(b * (n - 1) / rest, 1),
            "per_token_ms": round(1000 * rest / max(n - 1, 1), 3), "generation_ms": round(1000 * total, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU, few tokens (checks the script)")
    p.add_argument("--batch", type=int, action="append",
                   help="batch sizes (default 1 and 32; with --num-speculative-tokens one, default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="eager paratron and HF (compiled on GPU by default)")
    p.add_argument("--no-hf", action="store_true", help="paratron only")
    p.add_argument("--config", default="llama-1b", help="the preset (hybrid-mini: a hybrid stack)")
    p.add_argument("--family", default=None, help="the Hugging Face family of the baseline (default: nemotron_h "
                   "for a hybrid preset, else llama)")
    p.add_argument("--hf-compile", choices=("auto", "manual", "off"), default="auto",
                   help="how HF generate is compiled on GPU (see hf_runner; default %(default)s)")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--num-speculative-tokens", type=int, action="append",
                   help="measure speculative decoding with K drafts (repeatable) beside plain decoding")
    p.add_argument("--kernel-decode-gemv", choices=("auto", "triton", "torch"), default=None,
                   help="paratron's decode-step linear layers (kernels/gemv.py; triton needs a GPU)")
    p.add_argument("--kernel-decode-attention", choices=CHOICES["kernel_decode_attention"], default=None,
                   help="paratron's decode attention (fused: batch 1's rotation, cache write and attention in one "
                   "kernel, kernels/decode_rotary.py; fused_qkv: with the QKV projection, kernels/"
                   "decode_qkv_attention.py)")
    p.add_argument("--model-args", default="", help="more paratron flags of the model, one string after '=' (e.g. "
                   "--model-args=\"--no-bias-swiglu-fusion\"); the record's name says them")
    p.add_argument("--load", help="with --num-speculative-tokens: a checkpoint trained with --mtp-num-layers")
    p.add_argument("--prompt-kind", choices=("counting", "random"), default="counting",
                   help="with --num-speculative-tokens: the prompts (default %(default)s)")
    args = p.parse_args()
    args.family = args.family or ("nemotron_h" if "hybrid" in args.config else "llama")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_ = device.type == "cuda" and not args.no_compile
    if args.num_speculative_tokens:
        if not (args.load or args.tiny):
            p.error("--num-speculative-tokens needs --load CKPT (trained with --mtp-num-layers) or --tiny")
        return speculative_main(args, device, dtype, compile_)
    plen = args.prompt_len or (8 if args.tiny else 128)
    n = args.new_tokens or (8 if args.tiny else 256)
    batches = args.batch or [1, 32]
    extra = tuple(args.model_args.split())
    model, hf, vocab, m = build(args.tiny, device, dtype, args.config, args.family, args.kernel_decode_gemv,
                                args.kernel_decode_attention, extra)
    name = ("tiny" if args.tiny else args.config) + (f"_gemv-{args.kernel_decode_gemv}" if args.kernel_decode_gemv
                                                      else "") + (f"_attention-{args.kernel_decode_attention}"
                                                                  if args.kernel_decode_attention else "")
    name += f"_{args.family}" if LAYER_FLAGS.get(args.family) else ""
    name += "".join("_" + a.lstrip("-") for a in extra)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {hardware}; {name}, prompt {plen}, {n} new tokens, compile {compile_}",
          flush=True)
    systems = [("paratron", paratron_runner(model, vocab, compile_))]
    if not args.no_hf:
        hf_mode = args.hf_compile if compile_ else "off"
        static = args.family in LAYER_FLAGS  # (a hybrid model's recurrent cache is transformers' own)
        hf_mode = hf_mode if static else "off"
        systems.append(("hf-static" + ("" if hf_mode == "off" else f"-compile-{hf_mode}") if static else "hf",
                        hf_runner(hf, hf_mode, static)))
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = torch.randint(0, vocab, (b, plen), generator=g).to(device)
        outputs = {}
        for system, run in systems:
            r = dict(system=system, batch=b, **measure(run, prompts, n, args.repeats, args.warmup, device))
            outputs[system] = run(prompts, n)
            rows.append(r)
            print(json.dumps(r), flush=True)
        if len(outputs) == 2:  # same weights, greedy: the tokens should agree (bf16 may flip near-ties)
            a, c = outputs.values()
            same = sum(x == y for ra, rc in zip(a, c) for x, y in zip(ra, rc)) / max(sum(len(r) for r in a), 1)
            rows[-1]["same_tokens_as_paratron"] = round(same, 3)
    bandwidth(rows, streamed_bytes(model), hardware)
    return report(rows, args, name, hardware, plen, n, compile_, paths_of(systems[0][1].engine))


def report(rows, args, name, hardware, plen, n, compile_, paths: str = "") -> int:
    hf_of = {r["batch"]: r for r in rows if r["system"].startswith("hf")}
    lines = [f"| system | batch | time to first token ms | time of {n} tokens ms | decode tokens/s | vs HF "
             "| weights TB/s (share of HBM) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = hf_of.get(r["batch"])
        ratio = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x" if ref and r is not ref else ""
        rate = ""
        if "weights_tb_s" in r:  # (paratron's rows; the share where the GPU's kind is known)
            rate = f"{r['weights_tb_s']}" + (f" ({100 * r['hbm_share']:.0f} %)" if "hbm_share" in r else "")
        lines.append(f"| {r['system']} | {r['batch']} | {r['ttft_ms']} | {r['generation_ms']} | "
                     f"{r['decode_tok_s']} | {ratio} | {rate} |")
    return write(args, rows, lines, f"decode_bench_{name}", f"Decode speed: {name}", hardware,
                 f"prompt {plen} tokens, {n} new tokens, greedy, random weights", compile_, paths)


if __name__ == "__main__":
    sys.exit(main())
