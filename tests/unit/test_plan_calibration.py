"""``paratron plan`` against measured runs of the offload paths and of small compiled micro-batches (records under
benchmarks/results/): the step time within 20 % and the peak allocated memory within 10 % (the plan's stated bounds,
docs/plan.md). Three rows calibrate a constant each (``HOST_GBPS``: the activations' copies; ``HOST_ADAM_GBPS``: the
host's Adam of optimizer offload; ``HOST_COMPILED_LAYER_MS``: the host's issue time of a compiled layer); the others
are held out."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MOE = ["--config", "moe-mini", "--micro-batch-size", "8", "--global-batch-size", "8", "--use-distributed-optimizer",
       "--mock-data", "--lr", "3e-4"]
OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules"]
VARIANTS = "optimizer_memory_variants_1gpu_20261206_170636.md"
SMALL = "train_throughput_llama-1b_20261206_171227.md"
COMPILED = ["--config", "llama-1b", "--torch-compile", "--mock-data", "--lr", "1e-4"]
# (record, the text of its row, flags, GPU kind, measured step ms, measured peak allocated GiB)
ROWS = [
    (VARIANTS, "| shape alone | 1 (1) | 82842 | 197.8 | 49.7 |", MOE, "h100", 197.8, 49.7),
    # calibrates HOST_GBPS
    (VARIANTS, "| 35653 | 459.5 | 40.7 |", MOE + OFFLOAD + ["expert_fc1", "moe_act"], "h100", 459.5, 40.7),
    (VARIANTS, "| 26875 | 609.6 | 36.9 |", MOE + OFFLOAD + ["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                         "mlp_norm", "expert_fc1", "moe_act"], "h100", 609.6, 36.9),
    (VARIANTS, "| 79662 | 205.7 | 44.0 |", MOE + ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                                                 "--exp-avg-sq-dtype", "bf16"], "h100", 205.7, 44.0),
    ("train_throughput_llama-1b_20261202_214102.md", "| 817.0 | 20055 |",  # calibrates HOST_ADAM_GBPS
     ["--config", "llama-1b", "--micro-batch-size", "4", "--global-batch-size", "8", "--use-distributed-optimizer",
      "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--mock-data", "--lr", "1e-4"], "h200", 817.0,
     16.92),
    ("optimizer_memory_offload_1gpu_20261202_212628.md", "| offload | 1 (1) | 678 | 3022.0 | 101.7 |",
     ["--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
      "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
      "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
      "--vocab-size", "128256", "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
      "--global-batch-size", "1", "--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5", "--mock-data",
      "--tokenizer-type", "NullTokenizer", "--lr", "1e-4"], "h200", 3022.0, 101.7),
    (SMALL, "| 88.7 | 23096 |", COMPILED + ["--micro-batch-size", "1", "--global-batch-size", "1"], "h100", 88.7, 21.4),
    # calibrates HOST_COMPILED_LAYER_MS (host-bound)
    (SMALL, "| 86.6 | 47320 |", COMPILED + ["--micro-batch-size", "2", "--global-batch-size", "2"], "h100", 86.6, 24.0),
]


@pytest.mark.parametrize("record,row,flags,kind,step_ms,peak_gib", ROWS, ids=[
    "moe-mini", "moe-mini-experts-offloaded", "moe-mini-seven-offloaded", "moe-mini-bf16-moments",
    "llama-1b-opt-offload", "llama-8b-width-opt-offload-half", "llama-1b-compiled-mb1", "llama-1b-compiled-mb2"])
def test_plan_predicts_the_recorded_runs(record, row, flags, kind, step_ms, peak_gib):
    assert row in (RESULTS / record).read_text(), "the measured row is the record's"
    from paratron.config import parse_args
    from paratron.plan.cost import Cluster
    from paratron.plan.search import planned
    from paratron.train.host_ops import host_ops_for
    from paratron.train.traffic import traffic_for
    cfg = parse_args(flags + ["--train-iters", "10"])
    mem, step = planned(cfg, Cluster(1, 1, kind), host_ops_for(cfg, kind), traffic_for(cfg, kind))
    peak, t = mem.peak / 2 ** 30, step.total * 1e3
    assert abs(t / step_ms - 1) <= 0.2, (t, step_ms)
    assert abs(peak / peak_gib - 1) <= 0.1, (peak, peak_gib)
