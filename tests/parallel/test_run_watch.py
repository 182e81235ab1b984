"""Megatron's run watchers (paratron/train/watch.py) on gloo: --check-weight-hash-across-dp-replicas-interval
passes while DP 2 x EP 2 replicas agree (dense weights over dp_cp, experts over edp) and stops both
ranks naming the parameter when one rank's weight is changed; --log-progress writes Megatron's
progress.txt lines; --profile-ranks picks the traced ranks; --moe-layer-recompute maps onto
--recompute-modules moe."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ConfigError, parse_args
from tests.dist import run_ranks
from tests.parallel.common import run_steps, tiny_config
from tests.unit.test_train import TINY

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, expert_model_parallel_size=2)


def _ranks(rank, world):
    from paratron.train.loop import build_dims
    from paratron.train.watch import check_weight_hashes
    cfg = tiny_config("llama", world, **MOE, check_weight_hash_across_dp_replicas_interval=1)
    out = run_steps(cfg, 2)  # checked after each step: the replicas agree
    from paratron.train.loop import Trainer
    from tests.parallel.common import global_batches, micro_batches
    dims = build_dims(cfg)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims,
                      data=(micro_batches(global_batches(cfg, 1), cfg, dims.dp_rank, dims.dp), None))
    check_weight_hashes(trainer.models, dims, 0)
    name, p = next((n, p) for n, p in trainer.model.module.named_parameters() if "linear_proj" in n)
    if rank == 1:
        with torch.no_grad():
            p.view(-1)[3] += 1e-3  # one value of one replica
    try:
        check_weight_hashes(trainer.models, dims, 7)
        caught = None
    except RuntimeError as e:
        caught = str(e)
    trainer.close()
    return {"losses": out["losses"], "caught": caught, "name": name}


def test_weight_hash_check_passes_on_agreeing_replicas_and_stops_on_a_divergent_one(tmp_path):
    ranks = run_ranks(2, _ranks, tmp_dir=tmp_path)
    for r in ranks:
        assert len(r["losses"]) == 2
        assert r["caught"] is not None and f"parameter {r['name']} differs" in r["caught"], r["caught"]
        assert "iteration 7" in r["caught"]


def test_log_progress_writes_megatron_lines(tmp_path):
    from paratron.train.loop import pretrain
    cfg = parse_args(TINY + ["--train-iters", "4", "--save", str(tmp_path / "ck"), "--save-interval", "2",
                             "--log-progress", "--device", "cpu"])
    pretrain(cfg)
    lines = (tmp_path / "ck" / "progress.txt").read_text().splitlines()
    assert lines[0].endswith("\tStarting job") and "\t# GPUs: 1\t" in lines[0]
    saved = [line for line in lines if "\tSaved checkpoint\t" in line]
    assert [line.split("Iteration: ")[1].split("\t")[0] for line in saved] == ["2", "4"]
    assert "Tokens (in billions): " in saved[-1] and "TFLOP/s/GPU" in saved[-1]
    with pytest.raises(ConfigError, match="--log-progress writes <save>/progress.txt: add --save"):
        parse_args(TINY + ["--train-iters", "4", "--log-progress"])


def test_profile_ranks_and_moe_layer_recompute_flags():
    from paratron.train.watch import profiled
    log = parse_args(TINY + ["--train-iters", "4", "--profile", "--profile-ranks", "0", "3"]).log
    assert log.profile_ranks == [0, 3] and profiled(log, 3) and not profiled(log, 1)
    assert profiled(parse_args(TINY + ["--train-iters", "4", "--profile"]).log, 5)  # default: every rank
    tr = parse_args(TINY + ["--train-iters", "4", "--num-experts", "4", "--moe-layer-recompute"]).train
    assert tr.recompute_granularity == "selective" and tr.recompute_modules == ["moe"]
    with pytest.raises(ConfigError, match="--moe-layer-recompute has no effect without --num-experts"):
        parse_args(TINY + ["--train-iters", "4", "--moe-layer-recompute"])
