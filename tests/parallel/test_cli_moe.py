"""The seed's Mixtral command line (its MoE and parallel flags verbatim, small sizes, mock data) runs
under torchrun on 4 gloo processes (TP 2 with sequence parallelism, EP 2, expert-TP 2, the distributed
optimizer with overlapped parameter gathering) and logs the losses of the one-process run, with the
load-balancing loss in the log line."""
import re

from tests.parallel.cli import run_pretrain
from tests.parallel.test_cli_tp import FLAGS

SEED_MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--group-query-attention", "--num-query-groups",
            "2", "--swiglu"]
SEED_PARALLEL = ["--overlap-param-gather", "--use-distributed-optimizer", "--expert-model-parallel-size", "2",
                 "--sequence-parallel", "--tensor-model-parallel-size", "2"]
ITERS = 3


def test_seed_mixtral_flags_on_four_processes(tmp_path):
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = str(ITERS)
    single = run_pretrain(1, flags + SEED_MOE, iters=ITERS, log_dir=tmp_path)
    got = run_pretrain(4, flags + SEED_MOE + SEED_PARALLEL, iters=ITERS, log_dir=tmp_path)
    for a, b in zip(single, got):
        assert abs(a - b) <= 1e-4 * abs(a), (single, got)
    # the logged load-balancing loss (averaged over layers and ranks) is the one-process value too
    pattern = re.compile(r"load_balancing_loss: ([0-9.E+-]+)")
    balance = [[float(x) for x in pattern.findall((tmp_path / f"run_{n}.log").read_text())] for n in (1, 4)]
    assert len(balance[0]) == len(balance[1]) == ITERS, balance
    assert all(abs(a - b) <= 1e-4 * a for a, b in zip(*balance)), balance
