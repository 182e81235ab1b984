"""Loss curves and throughput of the same training run in several parallel layouts, through the
real command line (`torchrun pretrain_gpt.py ...`), side by side.

    python benchmarks/parallel_curves.py --base "--config gpt-350m --train-iters 50" \
        --run "tp1:1:" --run "tp2-sp:2:--tensor-model-parallel-size 2 --sequence-parallel"

Each --run is NAME:PROCESSES:FLAGS. Every run logs each iteration; the table gives each run's loss per
logged step, the largest relative difference from the first run, and tokens/s (all GPUs together,
mean over the logged steps after the first 5). ``--compare A:B`` adds the largest and mean relative
difference of run A from run B (e.g. a layout against its reference next to a noise pair).
``--concurrent`` starts the one-process runs together, run i on GPU i mod the GPU count, before the
others (their tokens/s are then not comparable: GPUs may be shared). Writes a Markdown record to
--record-dir (default: $OUT if set, else benchmarks/results).

``--docstring-data DIR`` prepares real English text first (the standard library's docstrings,
paratron.data.corpus.prepare_docstring_data: a WordPiece vocabulary, BERT sentence data and GPT document
data) and replaces ``{BERT_DATA}``, ``{GPT_DATA}`` and ``{VOCAB}`` in the flags: a tiny BERT beside a GPT of
the same size (``--model bert`` in a run's flags makes it BERT):

    python benchmarks/parallel_curves.py --docstring-data /tmp/doc --tag bert_text_curve_cpu \
        --base "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --max-position-embeddings 64 --micro-batch-size 16 --global-batch-size 16 --train-iters 200 --lr 1e-3 \
        --lr-warmup-iters 20 --vocab-file {VOCAB} --split 95,5,0 --num-workers 0 --device cpu" \
        --run "bert:1:--model bert --data-path {BERT_DATA}" --run "gpt:1:--data-path {GPT_DATA} \
        --tokenizer-type BertWordPieceLowerCase"
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def parse(stdout: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per logged iteration: the lm loss, the tokens/s per GPU and the grad norm (where logged)."""
    losses, tps, norms = {}, {}, {}
    for line in stdout.splitlines():
        m = re.search(r"iteration\s+(\d+)/", line)
        lm = re.search(r"lm loss: ([0-9.E+-]+) \|", line)
        if not (m and lm):
            continue
        it = int(m.group(1))
        losses[it] = float(lm.group(1))
        for pattern, into in ((r"tokens per second per GPU: ([0-9.]+)", tps), (r"grad norm: ([0-9.E+-]+)", norms)):
            found = re.search(pattern, line)
            if found:
                into[it] = float(found.group(1))
    return losses, tps, norms


def start(name: str, nproc: int, flags: str, base: str, gpu: Optional[int] = None) -> dict:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["pretrain_gpt.py", *shlex.split(base), "--log-interval", "1", "--eval-iters", "0", *shlex.split(flags)]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return {"name": name, "nproc": nproc, "flags": flags, "cmd": " ".join(cmd), "proc": proc, "t0": time.time(),
            "gpu": gpu}


def finish(r: dict, timeout: int) -> dict:
    try:
        out, err = r["proc"].communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        r["proc"].kill()
        out, err = r["proc"].communicate()
    losses, tps, norms = parse(out)
    steady = [v for k, v in sorted(tps.items()) if k > 5]
    rc = r.pop("proc").returncode
    r.update(rc=rc, losses=losses, grad_norms=norms,
             tokens_s=(sum(steady) / len(steady) * r["nproc"]) if steady else None,
             wall_s=time.time() - r["t0"], tail=(out + err)[-1500:] if rc else "")
    print(f"{r['name']}: rc {rc}, {len(losses)} logged steps, tokens/s {r['tokens_s']}, {r['wall_s']:.0f} s"
          + (f" (GPU {r['gpu']})" if r["gpu"] is not None else ""), flush=True)
    if rc:
        print(r["tail"], flush=True)
    return r


def rel_diffs(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [abs(a[k] - b[k]) / abs(b[k]) for k in b if k in a]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="flags common to every run")
    p.add_argument("--run", action="append", required=True, help="NAME:PROCESSES:FLAGS")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--compare", action="append", default=[], help="A:B - relative loss differences of run A from B")
    p.add_argument("--concurrent", action="store_true", help="start the one-process runs together, one per GPU")
    p.add_argument("--tag", default="parallel_curves")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--docstring-data", help="prepare the stdlib docstrings as BERT/GPT data in this directory")
    args = p.parse_args()
    if args.docstring_data:
        sys.path.insert(0, str(ROOT))
        from paratron.data.corpus import prepare_docstring_data
        data = prepare_docstring_data(args.docstring_data)
        for key, value in (("{BERT_DATA}", data["bert"]), ("{GPT_DATA}", data["gpt"]), ("{VOCAB}", data["vocab"])):
            args.base, args.run = args.base.replace(key, value), [r.replace(key, value) for r in args.run]
        print(f"docstring data: {data['documents']} documents in {args.docstring_data}", flush=True)
    specs = [(name, int(nproc), flags) for name, nproc, flags in (s.split(":", 2) for s in args.run)]
    done: dict[str, dict] = {}
    if args.concurrent:
        import torch
        gpus = max(torch.cuda.device_count(), 1)
        single = [s for s in specs if s[1] == 1]
        started = [start(*s, args.base, gpu=i % gpus) for i, s in enumerate(single)]
        for r in started:
            done[r["name"]] = finish(r, args.timeout)
    for s in specs:
        if s[0] not in done:
            done[s[0]] = finish(start(*s, args.base), args.timeout)
    results = [done[s[0]] for s in specs]
    ref = results[0]["losses"]
    lines = ["| run | processes | flags | tokens/s (all GPUs) | max rel. loss diff vs first | final loss |",
             "|---|---|---|---|---|---|"]
    for r in results:
        diff = max(rel_diffs(r["losses"], ref), default=float("nan"))
        final = r["losses"][max(r["losses"])] if r["losses"] else None
        tok = f"{r['tokens_s']:.0f}" if r["tokens_s"] else "-"
        lines.append(f"| {r['name']} | {r['nproc']} | `{r['flags']}` | {tok} | {diff:.2e} | {final} |")
    steps = sorted(ref)
    curve = ["| step | " + " | ".join(r["name"] for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    for k in steps:  # as logged (Megatron's 6 decimals), so that a 1e-6 difference shows
        curve.append(f"| {k} | " + " | ".join(f"{r['losses'].get(k, float('nan')):.6f}" for r in results) + " |")
    if any(r["grad_norms"] for r in results):
        curve += ["", "Grad norm per step:", "", curve[0], curve[1]]
        curve += [f"| {k} | " + " | ".join(f"{r['grad_norms'].get(k, float('nan')):.3f}" for r in results) + " |"
                  for k in steps]
    if args.compare:
        lines += ["", "| run | against | max rel. loss diff | mean rel. loss diff | steps |", "|---|---|---|---|---|"]
        for pair in args.compare:
            a, b = pair.split(":")
            d = rel_diffs(done[a]["losses"], done[b]["losses"])
            lines.append(f"| {a} | {b} | {max(d, default=float('nan')):.2e} | "
                         f"{(sum(d) / len(d)) if d else float('nan'):.2e} | {len(d)} |")
    for r in (r for r in results if r["rc"]):  # a run that stopped: its exit code and last output in the record
        lines += ["", f"Run `{r['name']}` stopped (exit code {r['rc']}, {r['wall_s']:.0f} s); the end of its output:",
                  "", "```", r["tail"].strip(), "```"]
    table, curves = "\n".join(lines), "\n".join(curve)
    print("\n" + table + "\n\n" + curves)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_record(args.record_dir, args.tag, args.tag,
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} x {device}",
                 {"base flags": f"`{args.base}`", "commands": "; ".join(f"`{r['cmd']}`" for r in results)},
                 table + "\n\nLoss per step:\n\n" + curves)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
