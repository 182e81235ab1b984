"""``paratron plan`` on clusters it cannot measure: a ranking with its derivation and command lines; and
``--dry-run``, which prints the start-up memory plan and builds nothing."""
import re

import pytest

from paratron.cli import main
from paratron.config import parse_args
from paratron.plan.layout import layout_of
from paratron.plan.memory import fullest
from tests.parallel.common import tiny_config

COMMON = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--bf16", "--tokenizer-type", "NullTokenizer", "--mock-data",
          "--micro-batch-size", "1"]
LLAMA_70B = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--group-query-attention",
             "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--seq-length", "8192",
             "--max-position-embeddings", "8192", "--global-batch-size", "128", "--vocab-size", "128256"]
DEEPSEEK_MOE = ["--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32", "--multi-latent-attention",
                "--q-lora-rank", "1024", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
                "--v-head-dim", "128", "--qk-layernorm", "--num-experts", "64", "--moe-router-topk", "6",
                "--moe-ffn-hidden-size", "1408", "--moe-shared-expert-intermediate-size", "2816",
                "--moe-layer-freq", "([0]*1+[1]*15)", "--ffn-hidden-size", "10944", "--seq-length", "4096",
                "--max-position-embeddings", "4096", "--global-batch-size", "1024", "--vocab-size", "102400"]


def plan(capsys, argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def ranked(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  TP"))
    return [line for line in lines[start + 1:] if line.strip() and line.split()[0].isdigit()]


def test_llama_70b_on_64_h100(capsys):
    out = plan(capsys, ["--gpus", "64", "--gpu", "h100", "--top", "5", *COMMON, *LLAMA_70B])
    rows = ranked(out)
    assert len(rows) == 5 and "layouts considered" in out and "does NOT fit" in out  # (as given: one GPU's layout)
    speeds = [float(r.split()[-1].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert all(float(r.split()[-3]) <= 80e9 / 2**30 for r in rows)  # what fits an 80 GB H100
    assert "torchrun --nnodes 8 --nproc-per-node 8 -m paratron train" in out and "memory (pipeline rank" in out
    for run in [line.split(" -m paratron train ")[1] for line in out.splitlines() if "  run: " in line]:
        cfg = parse_args(run.split() + ["--train-iters", "1", "--lr", "1e-4"], world_size=64)  # the command runs
        assert fullest(cfg.model, cfg.padded_vocab_size, layout_of(cfg, "h100"), cfg.parallel).total <= 80e9  # (its H100 paths)


@pytest.mark.slow  # (~25 s: the 256-GPU search; llama-70b's on 64 GPUs and the MoE calibration rows stay in CI)
def test_deepseek_style_moe_on_256_h100(capsys):
    out = plan(capsys, ["--gpus", "256", "--gpu", "h100", "--top", "3", "--explain", "1", *COMMON, *DEEPSEEK_MOE])
    assert len(ranked(out)) == 3 and "64 experts top-6" in out and "time: compute" in out


def test_dry_run_prints_the_memory_plan_and_builds_nothing(capsys):
    argv = ["--config", "tiny", "--dry-run", "--train-iters", "1", "--use-distributed-optimizer", "--device", "cpu"]
    assert main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "memory plan" in out and "optimizer" in out and "iteration" not in out


def test_trainer_prints_the_memory_plan_at_start_up(capsys):
    import torch
    from paratron.train.loop import Trainer
    cfg = tiny_config("llama", world_size=1)
    trainer = Trainer(cfg, device=torch.device("cpu"), data=(iter([]), None))
    trainer._announce()
    trainer.close()
    out = capsys.readouterr().out
    assert "memory plan (each rank, no_shard sharding, recompute none): predicted peak" in out and "gradients" in out


def test_a_run_the_plan_cannot_count_says_so_and_still_starts():
    from paratron.plan.memory import startup_lines
    mamba = dict(hybrid_layer_pattern="M*", mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16,
                 kernel_linear_scan_recompute="off")
    cfg = tiny_config("llama", world_size=1, **mamba)  # a sequence of 32 in one chunk of 128
    assert startup_lines(cfg) == [" memory plan: not available for runs with --kernel-linear-scan-recompute off with "
                                  "a sequence that is not two or more whole scan chunks (--mamba-chunk-size: the "
                                  "padded and the single-chunk scans' saved copies are not counted) (docs/plan.md)"]
    for counted in (tiny_config("llama", world_size=1, **mamba, mamba_chunk_size=8),
                    tiny_config("llama", world_size=1, **{**mamba, "kernel_linear_scan_recompute": "on"})):
        assert "predicted peak" in startup_lines(counted)[0]


def test_startup_lines_name_the_fullest_pipeline_rank():
    cfg = tiny_config("llama", world_size=4, num_layers=4, pipeline_model_parallel_size=4)
    mem = fullest(cfg.model, cfg.padded_vocab_size, layout_of(cfg), cfg.parallel)
    assert mem.pp_rank == 0 and mem.activations > 0  # the first stage holds PP micro-batches in flight


def test_a_host_bound_step_is_pointed_at_the_step_graph(capsys):
    """Eager llama-1b at micro-batch 1 waits on the host (counted operations): the plan names the step's CUDA graph,
    whose flags the config takes; not where the config refuses the graph (TP 2) or already replays it."""
    base = ["--gpu", "h100", "--top", "1", "--config", "llama-1b", "--micro-batch-size", "1", "--global-batch-size",
            "4", "--mock-data"]
    out = plan(capsys, ["--gpus", "1", *base])
    hint = [line for line in out.splitlines() if line.startswith("host-bound:")]
    assert len(hint) == 1 and "--cuda-graph-impl local --cuda-graph-scope full_iteration" in hint[0], out
    with_graph = plan(capsys, ["--gpus", "1", *base, "--cuda-graph-impl", "local", "--cuda-graph-scope",
                               "full_iteration"])
    assert "host-bound:" not in with_graph
    assert "host-bound:" not in plan(capsys, ["--gpus", "2", *base, "--tensor-model-parallel-size", "2"])


def test_a_host_bound_compiled_step_is_pointed_at_the_step_graph(capsys):
    """Compiled llama-1b at micro-batch 1 waits on the host too (the compiled layers' measured issue time, plan/host.py:
    88.7 ms measured against 39.8 with the graph, benchmarks/results/train_throughput_llama-1b_20261206_171227.md);
    at micro-batch 16 the GPU's time hides it."""
    base = ["--gpu", "h100", "--gpus", "1", "--top", "1", "--config", "llama-1b", "--torch-compile", "--mock-data"]
    out = plan(capsys, [*base, "--micro-batch-size", "1", "--global-batch-size", "1"])
    assert any(line.startswith("host-bound:") for line in out.splitlines()), out
    assert "host-bound:" not in plan(capsys, [*base, "--micro-batch-size", "16", "--global-batch-size", "16"])


def test_experts_in_a_loop_are_pointed_at_the_grouped_gemm(capsys):
    """An MoE config without --moe-grouped-gemm (Megatron's default: one matmul per expert) gets its own layout's
    step planned again with the flag (the loop's host operations and its backward's stacked gradients counted both
    ways), where that is faster; not with the flag given."""
    base = ["--gpus", "8", "--gpu", "h100", "--top", "1", *COMMON, "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "8", "--ffn-hidden-size", "1408", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--vocab-size", "32000", "--global-batch-size", "8",
            "--num-experts", "16", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "256"]
    hint = [line for line in plan(capsys, base).splitlines() if line.startswith("experts: one matmul per expert")]
    assert len(hint) == 1 and "--moe-grouped-gemm" in hint[0], hint
    loop, grouped = (float(x) for x in re.findall(r"([0-9.]+) s", hint[0]))
    assert grouped < loop
    assert "experts: one matmul" not in plan(capsys, base + ["--moe-grouped-gemm"])
