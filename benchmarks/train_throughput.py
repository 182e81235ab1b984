"""Training throughput of paratron's real training step on one device, optionally beside the
Hugging Face transformers baseline measured in the same process.

    python benchmarks/train_throughput.py --config gpt-350m [--hf] [--variant NAME:FLAGS ...] [--plan h200]
    python benchmarks/train_throughput.py --config hybrid-mini --hf-family nemotron_h --hf-micro-batch-size 2 \
        --variant "compiled-mb2:--torch-compile --micro-batch-size 2 --global-batch-size 2"
    python benchmarks/train_throughput.py --t5 [--micro-batch-size 32] [--steps 20]   # T5-220M (--tiny --t5-eager: CPU)
    python benchmarks/train_throughput.py --bert [--hf] [--micro-batch-size 8]   # BERT-340M (--tiny: CPU check)

Each variant is a set of extra Megatron/paratron flags (e.g. `compiled:--torch-compile`, or a kernel switch
such as `--kernel-fp8-grad-cast off`). With more than one variant each runs in a fresh child process (its
compiled kernels and allocator state its own). The step is
Trainer.train_step: model forward/backward on mock data through the real data path, gradient
buffer, AdamW on fp32 master weights, LR schedule. Timing: warm-up steps, then CUDA-synchronised
wall time over the timed steps. Writes a Markdown record (date, hardware, torch, commit, command,
table) to --record-dir (default: $OUT if set, else benchmarks/results). ``--hf-family F`` builds the Hugging Face
baseline from the preset itself (paratron's config converted to family F's config.json, transformers' own
model of that family with its own initialisation, bf16, torch.compile, torch's fused AdamW, the sequence and the
preset's micro-batch or ``--hf-micro-batch-size``: give the paratron variants the same): the baseline for presets that peers.py does not know (hybrid-mini: NemotronH). ``--plan KIND``: each
variant's peak memory and step time beside what ``paratron plan``'s models predict for it on that GPU kind
(docs/plan.md).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def predicted(cfg, kind: str, efficiency: float) -> dict:
    """paratron plan's peak allocated memory (GiB) and step time (ms) of the run's layout on one ``kind`` GPU."""
    from paratron.plan.cost import Cluster
    from paratron.plan.search import planned
    from paratron.train.host_ops import host_ops_for
    from paratron.train.traffic import traffic_for
    mem, t = planned(cfg, Cluster(1, 1, kind, matmul_efficiency=efficiency), host_ops_for(cfg, kind),
                     traffic_for(cfg, kind))
    return dict(plan_mem_gib=round(mem.peak / 2**30, 2), plan_step_ms=round(t.total * 1e3, 1))


def settled(warmup: int) -> int:
    """Warm-up steps: at least cuBLASLt's re-timing call (kernels/cublaslt.py times each GEMM shape's algorithms at
    its first and its RETUNE_AT-th call, ~100 extra GEMMs per shape: inside the timed steps they would count)."""
    from paratron.kernels.cublaslt import RETUNE_AT
    return max(warmup, RETUNE_AT)


def run_paratron(preset: str, flags: list[str], warmup: int, steps: int, plan=None) -> dict:
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    from paratron.train.metrics import flops_per_iteration, peak_tflops
    cfg = parse_args(["--config", preset, "--train-iters", str(warmup + steps + 1), "--eval-iters", "0",
                      "--log-interval", "1000000", *flags])
    plan_row = predicted(cfg, *plan) if plan else {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = Trainer(cfg)
    losses = []
    t0 = time.perf_counter()
    warmup = settled(warmup)
    for _ in range(warmup):
        t.train_step()
    sync()
    warmup_s = time.perf_counter() - t0
    print(f"  warm-up ({warmup} steps, compilation included): {warmup_s:.0f} s", flush=True)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if torch.cuda.is_available() else []
    start = time.perf_counter()
    for i in range(steps):
        if marks:
            marks[i].record()
        report, _, _ = t.train_step()
        losses.append(report)
    if marks:
        marks[-1].record()
    sync()
    dt = (time.perf_counter() - start) / steps
    each = sorted(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))  # (the GPU's time between step boundaries)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    flops = flops_per_iteration(cfg.model, cfg.padded_vocab_size, cfg.train.global_batch_size, cfg.model.seq_length)
    peak = peak_tflops(t.device) or 989.0
    loss = float(losses[-1][0] / losses[-1][1])
    out = dict(step_ms=round(dt * 1e3, 1), tok_s=round(tokens / dt), tflops=round(flops / dt / 1e12, 1),
               mfu=round(100 * flops / dt / 1e12 / peak, 1),
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else None,
               loss=round(loss, 3), micro_batch=cfg.train.micro_batch_size, flops_per_token=flops / tokens,
               warmup_s=round(warmup_s), **plan_row)
    if each:  # a uniformly slow run and one slow step read differently
        out["step_ms_min_median_max"] = [round(each[0], 1), round(each[len(each) // 2], 1), round(each[-1], 1)]
    if plan and torch.cuda.is_available():
        out["mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    t.close()
    del t
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_hf(preset: str, compiled: bool) -> dict:
    """The peers' baseline (../shared/bench/peers.py, carried in $PEERS_DIR, default .peers/), same process."""
    sys.path.insert(0, os.environ.get("PEERS_DIR") or str(ROOT / ".peers"))
    import peers  # noqa: E402  (only present where carried)
    torch.cuda.reset_peak_memory_stats()
    r = peers.hf(peers.CONFIGS[preset], compiled)
    # peers counts FLOPs differently (no causal discount); report Megatron-formula MFU beside it
    gc.collect()
    torch.cuda.empty_cache()
    return r


def run_hf_family(preset: str, family: str, warmup: int, steps: int, micro_batch: int | None = None) -> dict:
    """transformers' model of ``family`` built from ``preset``'s config, compiled, one micro-batch per step (the
    preset's micro-batch unless ``micro_batch``)."""
    import transformers

    from paratron.checkpoint.hf_config import hf_config_from_model_config
    from paratron.config import parse_args
    cfg = parse_args(["--config", preset])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_cfg = hf_config_from_model_config(cfg.model, cfg.data.vocab_size, family)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "torch_dtype"})
    model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16).train()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    b, s = micro_batch or cfg.train.micro_batch_size, cfg.model.seq_length
    ids = torch.randint(0, cfg.data.vocab_size, (b, s + 1), device=device)

    def step():
        compiled(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = bert_measure(step, warmup, steps)
    return dict(step_ms=round(dt * 1e3, 1), tok_s=round(b * s / dt),
                peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None)


def run_variant(args, flags: str) -> dict:
    """One variant in this process."""
    try:
        plan = (args.plan, args.plan_efficiency) if args.plan else None
        return run_paratron(args.config, flags.split(), args.warmup, args.steps, plan)
    except Exception as e:  # record the failure, keep measuring the rest
        import traceback
        traceback.print_exc()
        return dict(error=repr(e)[:300])


def run_child(args, name: str, flags: str) -> dict:
    """One variant in a fresh Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, __file__, "--config", args.config, "--warmup", str(args.warmup), "--steps",
               str(args.steps), "--variant", f"{name}:{flags}", "--child-json", str(out)]
        cmd += [f"--inductor={kv}" for kv in args.inductor] + ([f"--blas={args.blas}"] if args.blas else [])
        cmd += [f"--plan={args.plan}", f"--plan-efficiency={args.plan_efficiency}"] if args.plan else []
        rc = subprocess.run(cmd).returncode
        return json.loads(out.read_text()) if out.exists() else dict(error=f"variant process exited with {rc}")


def plan_table(rows: list[dict]) -> str:
    """Predicted against measured, per variant (paratron plan's acceptance: memory 10 %, time 20 %)."""
    out = ["| variant | predicted GiB | max allocated GiB | error | max reserved GiB | predicted ms | step ms | error |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "plan_mem_gib" in r and r.get("mem_gib"):
            out.append(f"| {r['system']} `{r['flags']}` | {r['plan_mem_gib']} | {r['mem_gib']} | "
                       f"{r['plan_mem_gib'] / r['mem_gib'] - 1:+.1%} | {r['reserved_gib']} | {r['plan_step_ms']} | "
                       f"{r['step_ms']} | {r['plan_step_ms'] / r['step_ms'] - 1:+.1%} |")
    return "\n".join(out)


T5_SIZES = {"220m": dict(layers=12, hidden=768, heads=12, kv=64, ffn=3072, enc=512, dec=128, vocab=32128),
         "tiny": dict(layers=2, hidden=64, heads=4, kv=16, ffn=128, enc=64, dec=32, vocab=512)}


def t5_config(s: dict):
    from paratron.config import ModelConfig
    return ModelConfig(model="t5", num_layers=s["layers"], decoder_num_layers=s["layers"], hidden_size=s["hidden"],
                       num_attention_heads=s["heads"], kv_channels=s["kv"], ffn_hidden_size=s["ffn"],
                       seq_length=s["enc"], encoder_seq_length=s["enc"], decoder_seq_length=s["dec"],
                       position_embedding_type="relative", normalization="RMSNorm", norm_epsilon=1e-6, geglu=True,
                       openai_gelu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                       softmax_scale=1.0, hidden_dropout=0.0, attention_dropout=0.0).resolved()


def t5_batch(s: dict, b: int, device):
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(2, s["vocab"], (b, s["enc"]), generator=g).to(device)
    dec = torch.randint(2, s["vocab"], (b, s["dec"]), generator=g).to(device)
    return enc, dec, dec.roll(-1, 1)


def t5_paratron_step(s: dict, b: int, device, compile_: bool = True):
    from paratron.model.t5 import T5Model
    model = T5Model(t5_config(s), s["vocab"], device=device, dtype=torch.bfloat16)
    for layer in [*model.encoder.layers, *model.decoder.layers] if compile_ else []:  # regional, as --torch-compile
        layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    enc, dec, labels = t5_batch(s, b, device)

    def step():
        loss = model(enc, dec, labels=labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def t5_hf_step(s: dict, b: int, device, compile_: bool = True):
    import transformers
    cfg = transformers.T5Config(vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["kv"], d_ff=s["ffn"],
                                num_layers=s["layers"], num_heads=s["heads"], feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).to(device, torch.bfloat16)
    compiled = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    enc, dec, labels = t5_batch(s, b, device)

    def step():
        loss = compiled(input_ids=enc, decoder_input_ids=dec, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def t5_timed(step, steps: int, device) -> float:
    """Seconds per step after two warm-up steps (compilation)."""
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / steps


def t5_main(args) -> int:
    """``--t5``: T5 (the sizes of Megatron's examples/t5/train_t5_220m_distributed.sh in the T5 v1.1 layout:
    relative buckets, RMSNorm, gated GeLU, no biases, untied head), paratron's T5Model with each layer compiled
    beside transformers' T5ForConditionalGeneration with torch.compile: the same batch and numerics (bf16 weights
    and activations, torch's AdamW on them on both sides), tokens/s (encoder + decoder tokens), TFLOP/s by
    paratron's T5 FLOPs formula (paratron/train/t5_step.py) and MFU. ``--tiny --t5-eager``: a CPU check."""
    from paratron.train.metrics import peak_tflops
    from paratron.train.t5_step import t5_flops_per_iteration
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s, b = T5_SIZES["tiny" if args.tiny else "220m"], args.micro_batch_size
    flops, peak = t5_flops_per_iteration(t5_config(s), s["vocab"], b), peak_tflops(device)
    rows = []
    for name, make in (("paratron T5Model", t5_paratron_step), ("HF T5" + ("" if args.t5_eager else " + compile"),
                                                                t5_hf_step)):
        sec = t5_timed(make(s, b, device, not args.t5_eager), args.steps, device)
        tflops = flops / sec / 1e12
        mfu = f"{100 * tflops / peak:.1f} %" if peak else "n/a"
        rows.append(f"| {name} | {sec * 1e3:.1f} | {b * (s['enc'] + s['dec']) / sec:,.0f} | {tflops:.1f} | {mfu} |")
    table = "\n".join(["| model | ms / step | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|", *rows])
    print(table)
    if not args.tiny:
        hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        write_record(args.record_dir, "train_throughput_t5-220m", "T5-220M training throughput beside HF + compile",
                     hw, {"batch": f"{b} x ({s['enc']} encoder + {s['dec']} decoder tokens)"}, table)
    return 0


# ---- --bert: BERT-340M beside transformers' BertForPreTraining ------------------------------------

BERT_340M = dict(layers=24, hidden=1024, heads=16, seq=512, vocab=30522)
TINY = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512)


def bert_flops_per_token(m: dict) -> float:
    h, L, s, V = m["hidden"], m["layers"], m["seq"], m["vocab"]
    return 6 * (12 * L * h * h + h * h + h * V) + 12 * L * s * h


def bert_batches(m: dict, mbs: int, n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = m["seq"]
        text = torch.randint(5, m["vocab"], (mbs, s), generator=g)
        real = torch.arange(s).expand(mbs, s) < torch.randint(s // 2, s + 1, (mbs, 1), generator=g)
        masked = (torch.rand(mbs, s, generator=g) < 0.15) & real
        out.append({"text": text * real, "types": (torch.arange(s) >= s // 2).long().expand(mbs, s) * real,
                    "labels": torch.where(masked, text, -1), "is_random": torch.randint(0, 2, (mbs,), generator=g),
                    "loss_mask": masked.long(), "padding_mask": real.long()})
    return out


def bert_measure(step, warmup: int, steps: int) -> float:
    """Seconds per call of ``step`` after ``warmup`` calls (the device synchronised around the timed ones)."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def run_bert_paratron(m: dict, mbs: int, warmup: int, steps: int, tiny: bool, extra: tuple = ()) -> float:
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    flags = ["--model", "bert", "--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
             "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]), "--max-position-embeddings",
             str(m["seq"]), "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs), "--train-iters",
             str(warmup + steps + 1), "--lr", "1e-4", "--data-path", "unused", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(m["vocab"]), "--eval-iters", "0", "--log-interval", "1000000"]
    flags += [] if tiny else ["--bf16", "--torch-compile"]
    cfg = parse_args(flags + list(extra))
    data = iter(bert_batches(m, mbs, warmup + steps))
    trainer = Trainer(cfg, data=(data, None))
    dt = bert_measure(trainer.train_step, warmup, steps)
    trainer.close()
    return dt


def run_bert_hf(m: dict, mbs: int, warmup: int, steps: int, tiny: bool) -> float:
    import transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.BertConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], num_hidden_layers=m["layers"],
                                     num_attention_heads=m["heads"], intermediate_size=4 * m["hidden"],
                                     max_position_embeddings=m["seq"], attn_implementation="sdpa")
    model = transformers.BertForPreTraining(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    fwd = model if tiny else torch.compile(model)
    data = [{k: v.to(device) for k, v in b.items()} for b in bert_batches(m, mbs, 1)]
    b = data[0]
    labels = torch.where(b["labels"] >= 0, b["labels"], -100)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not tiny):
            out = fwd(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"],
                      labels=labels, next_sentence_label=b["is_random"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return bert_measure(step, warmup, steps)


def bert_main(args) -> int:
    """--bert: BERT-340M (paratron's BertModel, ``--model bert``) beside transformers' BertForPreTraining +
    torch.compile at the same batch (bf16 compute, fp32 master weights and AdamW); --tiny: a CPU check."""
    m = TINY if args.tiny else BERT_340M
    warmup, steps = (1, 2) if args.tiny else (args.warmup, args.steps)
    mbs = args.micro_batch_size
    tokens, fpt = mbs * m["seq"], bert_flops_per_token(m)
    rows = ["| system | step ms | tokens/s | TFLOP/s | MFU % | peak GiB |", "|---|---|---|---|---|---|"]
    variants = [v.split(":", 1) if ":" in v else (v, "") for v in args.variant]  # paratron's runs, flags added
    systems = [(f"paratron {name}", functools.partial(run_bert_paratron, extra=tuple(flags.split())))
               for name, flags in variants] or [("paratron", run_bert_paratron)]
    systems += [("transformers + torch.compile", run_bert_hf)] if args.hf else []
    for name, fn in systems:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        dt = fn(m, mbs, warmup, steps, args.tiny)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")
        tflops = tokens * fpt / dt / 1e12
        rows.append(f"| {name} | {dt * 1e3:.1f} | {tokens / dt:.0f} | {tflops:.1f} | {100 * tflops / 989:.1f} | "
                    f"{peak:.1f} |")
        print(rows[-1], flush=True)
        gc.collect()
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    write_record(args.record_dir, "train_throughput_bert" + ("_tiny" if args.tiny else "_340m"),
                 "BERT training throughput: paratron beside transformers + torch.compile", hardware,
                 {"model": str(m), "micro batch": str(mbs), "variants": "; ".join(args.variant) or "none",
                  "FLOPs per token": "6 x (12 L h^2 + h^2 + h V) + 12 L s h "
                  "(bidirectional attention), the same for both"}, "\n".join(rows))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-350m")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:FLAGS, e.g. 'compiled:--torch-compile --micro-batch-size 8' (repeatable)")
    p.add_argument("--hf", action="store_true", help="also run HF transformers + torch.compile (needs peers.py in $PEERS_DIR or .peers/)")
    p.add_argument("--hf-eager", action="store_true", help="also run HF transformers eager")
    p.add_argument("--hf-family", default=None, help="also run transformers' model of this family (e.g. nemotron_h) "
                   "built from the preset, compiled")
    p.add_argument("--hf-micro-batch-size", type=int, default=None,
                   help="--hf-family: its micro-batch (default the preset's; give the paratron variants the same)")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="set torch._inductor.config.KEY (an experiment knob, e.g. coordinate_descent_tuning=True)")
    p.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                   help="torch.backends.cuda.preferred_blas_library for the paratron variants (experiment)")
    p.add_argument("--plan", default=None, metavar="GPU_KIND",
                   help="also the plan's predicted peak memory and step time of each variant (h100 | h200 | a100)")
    p.add_argument("--plan-efficiency", type=float, default=0.5, help="the plan's --matmul-efficiency")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # run_child's: one variant, its result here
    p.add_argument("--t5", action="store_true", help="T5-220M beside HF T5 + torch.compile instead (t5_main; "
                   "--micro-batch-size, --tiny as --bert's)")
    p.add_argument("--t5-eager", action="store_true", help="--t5 without torch.compile on either side")
    p.add_argument("--bert", action="store_true", help="BERT-340M (--hf: beside transformers' BertForPreTraining; "
                   "--variant NAME:FLAGS: paratron runs with those flags added, one after another)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="--bert / --t5: the micro-batch")
    p.add_argument("--tiny", action="store_true", help="--bert / --t5: a CPU check (2 layers, hidden 64)")
    args = p.parse_args()
    if args.bert:
        return bert_main(args)
    if args.t5:
        return t5_main(args)
    for kv in args.inductor:
        import torch._inductor.config as ic
        key, value = kv.split("=", 1)
        ic.__setattr__(key, {"True": True, "False": False}.get(value, value))
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    variants = [v.split(":", 1) if ":" in v else (v, "") for v in args.variant] or [("default", "")]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}; preset {args.config}", flush=True)
    rows = []
    for name, flags in variants:
        r = run_child(args, name, flags) if len(variants) > 1 else run_variant(args, flags)
        r.update(system=f"paratron {name}", flags=flags)
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.child_json:
            Path(args.child_json).write_text(json.dumps(r))
            return 0
    for compiled, wanted in ((False, args.hf_eager), (True, args.hf)):
        if not wanted:
            continue
        try:
            r = run_hf(args.config, compiled)
        except Exception as e:
            r = dict(error=repr(e)[:300])
        r.update(system="hf-compile" if compiled else "hf-eager", flags="")
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.hf_family:
        try:
            r = run_hf_family(args.config, args.hf_family, args.warmup, args.steps, args.hf_micro_batch_size)
        except Exception as e:
            r = dict(error=repr(e)[:300])
        r.update(system="hf-compile", flags=f"transformers {args.hf_family}")
        rows.append(r)
        print(json.dumps(r), flush=True)
    hf_tok = next((r["tok_s"] for r in rows if r["system"] == "hf-compile" and "tok_s" in r), None)
    header = ("| system | flags | step ms | tokens/s | TFLOP/s | MFU % | peak GiB | loss | vs HF+compile "
              "| GPU ms per step: min / median / max |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tok_s'] / hf_tok:.2f}x" if hf_tok and "tok_s" in r else ""
        spread = " / ".join(str(v) for v in r.get("step_ms_min_median_max", []))
        lines.append(f"| {r['system']} | `{r['flags']}` | {r.get('step_ms')} | {r.get('tok_s')} | {r.get('tflops')} | "
                     f"{r.get('mfu')} | {r.get('peak_mem_gb')} | {r.get('loss')} | {ratio} | {spread} |"
                     + (f" error: {r['error']}" if "error" in r else ""))
    if args.plan:
        lines += ["", plan_table(rows)]
    table = "\n".join(lines)
    print("\n" + table)
    write_record(args.record_dir, f"train_throughput_{args.config}", f"Training throughput: {args.config}", device,
                 {"inductor settings": " ".join(args.inductor) or "defaults",
                  "BLAS": args.blas or "torch default",
                  "method": f"{settled(args.warmup)} warm-up steps (HF rows: {args.warmup}) + {args.steps} timed steps, "
                            "CUDA-synchronised wall time (paratron rows: each step's GPU time between CUDA "
                            "events too); MFU by "
                            "the Megatron FLOPs formula against 989 TFLOP/s (HF rows: peers.py's own FLOPs count)"},
                 table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
