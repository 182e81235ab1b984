"""Megatron-LM's own training scripts through paratron, scaled down to one CPU process (issue 19).

    python benchmarks/megatron_examples.py [--megatron PATH] [--only NAME] [--out benchmarks/results/megatron_examples.md]

The flags of each script (tests/data/megatron_example_scripts.json; ``--megatron PATH`` extracts them
again from a Megatron-LM checkout) are kept as the script has them, except the sizes (layers, widths,
heads, experts, sequence, batch, iterations), the parallel degrees (all 1), the data (``--mock-data``;
GPT-2 vocab/merges files are replaced by a tiny generated pair, other tokenizer files by a NullTokenizer; a
BERT script gets a small generated sentence-level dataset and its WordPiece vocab.txt, made by
``paratron preprocess --split-sentences``) and the paths (a temporary directory). Each scaled command line runs
``pretrain_gpt.py --device cpu`` (``pretrain_bert.py`` for examples/bert, ``pretrain_t5.py`` for examples/t5, on the
generated sentence data; the hybrid script ``pretrain_hybrid.py``, with its pattern scaled to 5 layers and Mamba-2
sizes that fit the width);
the table says whether it ran to the end or stopped with a one-line refusal, and which. Scripts that log
to W&B need the wandb package (``pip install 'paratron[wandb]'``; offline mode), as they would in a real run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "data" / "megatron_example_scripts.json"
EXAMPLES = ("examples/gpt3/train_gpt3_175b_distributed.sh", "examples/bert/train_bert_340m_distributed.sh",
            "examples/llama/train_llama3_8b_h100_fp8.sh",
            "examples/mixtral/train_mixtral_8x7b_distributed.sh",
            "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh", "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
            "examples/gptoss/02_train.sh", "examples/post_training/modelopt/conf/Qwen/Qwen3-8B.sh",
            "examples/post_training/modelopt/conf/meta-llama/Llama-3.1-8B-Instruct.sh",
            "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh",
            "examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh", "examples/mamba/train.sh",
            "examples/t5/train_t5_220m_distributed.sh")
# each script's entry point (default pretrain_gpt.py)
ENTRY = {"examples/mamba/train.sh": "pretrain_hybrid.py", "examples/bert/train_bert_340m_distributed.sh": "pretrain_bert.py",
         "examples/t5/train_t5_220m_distributed.sh": "pretrain_t5.py"}
# a hybrid script's scaled pattern, and Mamba-2 sizes that fit the scaled width (Megatron's defaults need >= 512)
HYBRID_SIZES = ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
CONFIGS_PER_DIR = 6  # functional-test configs taken from each directory (spread over its sorted list)
CONFIG_DIRS = ("tests/functional_tests/test_cases/gpt", "tests/functional_tests/test_cases/moe",
               "tests/functional_tests/test_cases/mixtral")
ITERS = 3
SIZES = {"num_layers": "2", "hidden_size": "64", "ffn_hidden_size": "128", "num_attention_heads": "4",
         "kv_channels": "16", "seq_length": "64", "max_position_embeddings": "64", "micro_batch_size": "2",
         "global_batch_size": "4", "train_iters": str(ITERS), "eval_iters": "1", "eval_interval": str(ITERS),
         "save_interval": str(ITERS), "log_interval": "1", "lr_decay_iters": str(ITERS), "lr_warmup_iters": "1",
         "save_retain_interval": str(ITERS), "pipeline_model_parallel_layout": None,
         "num_virtual_stages_per_pipeline_rank": None,
         "num_experts": "4", "moe_ffn_hidden_size": "64", "moe_shared_expert_intermediate_size": "64",
         "moe_layer_freq": "1", "num_query_groups": "2", "decoder_first_pipeline_num_layers": None,
         "decoder_last_pipeline_num_layers": None, "num_layers_per_virtual_pipeline_stage": None,
         "train_samples": None, "lr_decay_samples": None, "lr_warmup_samples": None, "lr_warmup_fraction": None,
         "rampup_batch_size": None, "exit_interval": None, "exit_duration_in_mins": None, "moe_router_topk": "2",
         "moe_router_num_groups": "2", "moe_router_group_topk": "1",  # 4 experts in 2 groups, top-2 within 1
         "hybrid_layer_pattern": "M-M*-", "encoder_num_layers": "2", "decoder_num_layers": "1",
         "encoder_seq_length": "64", "decoder_seq_length": "32"}
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size")
DATA = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "mock_data", "data_cache_path",
        "split", "per_split_data_args_path", "data_args_path", "tokenizer_model", "vocab_file", "merge_file",
        "tokenizer_type", "vocab_size", "tiktoken_pattern", "distributed_backend")
PATHS = ("save", "load", "tensorboard_dir", "wandb_save_dir", "pretrained_checkpoint", "ckpt_convert_save")
NAMES = {"wandb_project": "megatron-examples", "wandb_exp_name": "scaled-down"}  # W&B names (offline run)


def nargs_of() -> dict[str, str]:
    from paratron.config.megatron_flags import megatron_flags
    return {k: v.nargs for k, v in megatron_flags().items()}


def flags_of(tokens: list[str], nargs: dict[str, str]) -> list[list[str]]:
    """[[--flag, values...], ...] of a token stream (Megatron's arity decides what is a value)."""
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not re.fullmatch(r"--[a-z][a-z0-9_-]*", tok) or tok[2:].replace("-", "_") not in nargs:
            continue
        n, vals = nargs[tok[2:].replace("-", "_")], []
        while i < len(tokens) and n != "0" and not tokens[i].startswith("--") and tokens[i] not in (")", "\\"):
            vals.append(tokens[i])
            i += 1
            if n == "1" or (n.isdigit() and len(vals) == int(n)):
                break
        out.append([tok, *vals])
    return out


def with_defaults(text: str) -> str:
    """A script's text with ``$VAR`` / ``${VAR}`` replaced by the value its own assignment gives the variable
    (``VAR=value`` or ``VAR=${VAR:-default}``, the default taken), where it has one."""
    values = {}
    for name, default, plain in re.findall(r'^\s*(?:export\s+)?(\w+)=(?:\$\{\w+:-"?([^}"]*)"?\}|"?([^\s"$]+)"?)\s*$',
                                           text, re.M):
        if default or plain:
            values[name] = default or plain
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def extract(megatron: Path) -> dict[str, list[list[str]]]:
    import yaml
    nargs, out = nargs_of(), {}
    for rel in EXAMPLES:
        text = with_defaults((megatron / rel).read_text())
        lexer = shlex.shlex(text.replace("(", " ( ").replace(")", " ) "), posix=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        out[rel] = flags_of([w for tok in lexer for w in tok.split()], nargs)  # "--a 1 --b" strings too
    for d in CONFIG_DIRS:
        found = []
        for f in sorted((megatron / d).glob("*/model_config.yaml")):
            spec = yaml.safe_load(f.read_text()) or {}
            if spec.get("MODE") != "inference" and spec.get("MODEL_ARGS") and "1node" not in str(f):
                found.append((f, spec))
        for f, spec in found[::max(len(found) // CONFIGS_PER_DIR, 1)][:CONFIGS_PER_DIR]:
            toks = []
            for k, v in spec["MODEL_ARGS"].items():
                toks += [k] if v is True else [] if v is False else [k, *str(v).split()]
            out[str(f.relative_to(megatron))] = flags_of(toks, nargs)
    return out


def is_bert(rel: str) -> bool:
    """BERT and T5 scripts read sentence-level data and a WordPiece vocab.txt."""
    return "/bert/" in rel or "/t5/" in rel


def tiny_bert(tmp: Path) -> tuple[str, str]:
    """(prefix of a small sentence-level dataset, its vocab.txt): tests/bert_helpers.py's generated corpus."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bert_helpers import bert_data
    return bert_data(tmp, docs=400)


def scale(flags: list[list[str]], tmp: Path, gpt2: tuple[str, str], bert=None) -> tuple[list[str], list[str]]:
    """(scaled argv, notes) of a script's flags; ``bert``: (data prefix, vocab.txt) of a BERT script."""
    names = {f[0][2:].replace("-", "_") for f in flags}
    argv, notes = [], []
    for f in flags:
        name = f[0][2:].replace("-", "_")
        if name in SIZES:
            if SIZES[name] is not None and (name not in ("num_query_groups",) or "group_query_attention" in names):
                argv += [f[0], SIZES[name]]
        elif name in PARALLEL or name in DATA:
            continue
        elif name in NAMES:
            argv += [f[0], NAMES[name]]
        elif name in PATHS:
            argv += [f[0], str(tmp / name)] if name != "load" else [f[0], str(tmp / "save")]
        else:
            values = [re.sub(r"\$\{\w+:-\"?([^}\"]*)\"?\}", r"\1", v) for v in f[1:]]  # ${VAR:-default}
            if any("$" in v for v in values):
                notes.append(f"{f[0]} ${{...}} -> 1")
            argv += [f[0], *[re.sub(r"\$\{?\w+\}?", "1", v) for v in values]]
    if "step_batch_size_schedule" in names:
        argv = scale_schedule(argv)
    if "hybrid_layer_pattern" in names:
        argv += HYBRID_SIZES
    if "train_iters" not in names:
        argv += ["--train-iters", str(ITERS)]
    if "log_interval" not in names:  # the log line of the last iteration shows that it ran
        argv += ["--log-interval", "1"]
    if "lr" not in names:  # a model definition without its training schedule
        argv += ["--lr", "1e-4"]
        notes.append("no training flags: --lr 1e-4 added")
    types = [f[1] for f in flags if f[0] == "--tokenizer-type" and len(f) > 1]
    if bert is not None:  # pretrain_bert.py's default tokenizer reads the vocab.txt; real sentence data
        return argv + ["--data-path", bert[0], "--vocab-file", bert[1], "--device", "cpu", "--num-workers", "0",
                       "--split", "949,50,1"], notes
    if {"vocab_file", "merge_file"} & names and types in ([], ["GPT2BPETokenizer"]):
        argv += ["--vocab-file", gpt2[0], "--merge-file", gpt2[1]]
    else:
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
        if {"tokenizer_model", "tokenizer_type"} & names:
            notes.append("tokenizer files -> NullTokenizer")
    argv += ["--mock-data", "--device", "cpu", "--num-workers", "0", "--split", "98,1,1"]
    return argv, notes


def scale_schedule(argv: list[str]) -> list[str]:
    """--step-batch-size-schedule with its batch sizes scaled so that the first is the scaled global batch
    (thresholds kept); a --global-batch-size beside it becomes the scaled final size."""
    argv = list(argv)
    i = argv.index("--step-batch-size-schedule") + 1
    entries = [e.split(":", 1) for e in argv[i].replace(",", " ").split()]
    first = min(entries, key=lambda e: float(e[0].rstrip("KMBTkmbt") or 0))[1]
    scaled = [(t, max(int(SIZES["global_batch_size"]) * int(b) // int(first), 1)) for t, b in entries]
    argv[i] = " ".join(f"{t}:{b - b % int(SIZES['micro_batch_size'])}" for t, b in scaled)
    if "--global-batch-size" in argv:
        argv[argv.index("--global-batch-size") + 1] = argv[i].split()[-1].split(":")[1]
    return argv


def tiny_gpt2(tmp: Path) -> tuple[str, str]:
    vocab = {"<|endoftext|>": 0, **{chr(c): i + 1 for i, c in enumerate(range(97, 123))}, "Ġ": 27}
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n")
    return str(tmp / "vocab.json"), str(tmp / "merges.txt")


def run_one(rel: str, flags: list[list[str]]) -> dict:
    with tempfile.TemporaryDirectory(prefix="mlm-example-") as d:
        tmp = Path(d)
        argv, notes = scale(flags, tmp, tiny_gpt2(tmp), tiny_bert(tmp) if is_bert(rel) else None)
        t0 = time.time()
        env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
        script = ENTRY.get(rel, "pretrain_gpt.py")
        r = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=env)
    done = re.search(rf"iteration\s+{ITERS}/\s*{ITERS} \|", r.stdout) is not None
    if r.returncode == 0 and done:
        result = "runs to the end"
    elif r.returncode == 0:
        result = "stopped early: " + next((ln.strip() for ln in r.stdout.splitlines() if "stopping at" in ln), "?")
    elif r.returncode == 2:
        result = "refused: " + r.stderr.strip().split("error: ", 1)[-1]
    else:
        result = f"FAILED (exit {r.returncode}): " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return {"script": rel, "flags": len(flags), "result": result, "notes": notes, "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron", help="a Megatron-LM checkout: extract the scripts' flags again")
    p.add_argument("--only", help="run the scripts whose path contains this")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "megatron_examples.md"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.megatron:
        scripts = extract(Path(args.megatron))
        SCRIPTS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in scripts.items()) + "\n}\n")
    scripts = json.loads(SCRIPTS.read_text())
    rows = [run_one(rel, fl) for rel, fl in scripts.items() if not args.only or args.only in rel]
    ran = sum(r["result"] == "runs to the end" for r in rows)
    refused = sum(r["result"].startswith("refused") for r in rows)
    lines = ["# Megatron-LM scripts through paratron, scaled down to one CPU process", "",
             "`python benchmarks/megatron_examples.py` (see its docstring for what is scaled). "
             f"{ran} of {len(rows)} run to the end, {refused} stop with a one-line refusal, "
             f"{len(rows) - ran - refused} fail otherwise.", "",
             "| script | flags | result | notes |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['script']}` | {r['flags']} | {r['result'].replace('|', '/')} | {'; '.join(r['notes'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
