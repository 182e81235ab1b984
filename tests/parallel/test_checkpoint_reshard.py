"""Sharded checkpoints reshard on load: a checkpoint saved at TP2 x PP2 (with or without the
distributed optimizer) resumes at other layouts with the losses the saving layout goes on to give.

All phases of a scenario run inside one 4-rank gloo job (the process group stays, each phase builds
its own ParallelDims), so the test pays for one start-up per model style."""
from __future__ import annotations

import pytest
import torch

from paratron.checkpoint import sharded
from tests.dist import run_ranks
from tests.parallel.common import global_batches, micro_batches, tiny_config

STEPS, SAVE_AT = 6, 3
SAVER = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
LOADERS = {  # name: layout on 4 ranks
    "tp1_pp1_dp4": dict(),
    "tp4": dict(tensor_model_parallel_size=4),
    "tp1_pp2_dp2": dict(pipeline_model_parallel_size=2),
}


def _train(style: str, layout: dict, dist_opt: bool, steps: range, save: str = None, load: str = None,
           bf16: bool = False) -> list[float]:
    """Train the given steps (of STEPS global batches) at ``layout``; save after the last one."""
    from paratron.train.loop import Trainer, build_dims
    cfg = tiny_config(style, use_distributed_optimizer=dist_opt, bf16=bf16, **layout, train_iters=STEPS, save=save,
                      load=load)
    dims = build_dims(cfg)
    batches = micro_batches(global_batches(cfg, STEPS), cfg, dims.dp_rank, dims.dp)
    per_step = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dims.dp)
    for _ in range(steps.start * per_step):  # the samples consumed before this run
        next(batches)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(batches, None))
    assert trainer.iteration == steps.start, (trainer.iteration, steps.start)
    losses = []
    for _ in steps:
        report, _, _ = trainer.train_step()
        losses.append((report[0] / report[1]).item())
    if save:
        trainer.save()
    trainer.close()
    return losses


def _scenario(rank: int, world: int, style: str, root: str) -> dict:
    out = {"ref": _train(style, SAVER, False, range(STEPS))}
    for dist_opt in (False, True):
        _train(style, SAVER, dist_opt, range(SAVE_AT), save=f"{root}/saved_dist{int(dist_opt)}")
    for name, layout in LOADERS.items():
        for saved_dist in (False, True):
            for dist_opt in (False, True):
                if dist_opt and layout.get("tensor_model_parallel_size") == 4:
                    continue  # DP 1: the distributed optimizer is the plain one
                out[(name, saved_dist, dist_opt)] = _train(style, layout, dist_opt, range(SAVE_AT, STEPS),
                                                           load=f"{root}/saved_dist{int(saved_dist)}")
    return out


@pytest.fixture(scope="module", params=["gpt", "llama"])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"reshard_{request.param}")
    return run_ranks(4, _scenario, request.param, str(tmp / "ckpt"), tmp_dir=tmp)


def test_resharded_resume_continues_the_saving_layouts_losses(runs):
    last = runs[-1]  # rank 3 is on the last pipeline stage in every layout: it has the (DP-reduced) loss
    ref = last["ref"]
    assert len(ref) == STEPS and all(x == x for x in ref)
    resumed = {k: v for k, v in last.items() if k != "ref"}
    assert len(resumed) == 10
    for (name, saved_dist, dist_opt), losses in resumed.items():
        for i, (a, b) in enumerate(zip(ref[SAVE_AT:], losses)):
            assert abs(a - b) <= 1e-5 * abs(a), \
                f"{name} (saved with dist opt {saved_dist}, loaded with {dist_opt}) step {SAVE_AT + i + 1}: {b} vs {a}"


def _bf16_roundtrip(rank: int, world: int, root: str) -> None:
    """Save at TP2 x PP2 with the distributed optimizer in bf16, load at TP1 x DP4 (plain) and at
    TP4, save again from each: every tensor of the re-saved checkpoints equals the original."""
    _train("llama", SAVER, True, range(2), save=f"{root}/a", bf16=True)
    _train("llama", LOADERS["tp1_pp1_dp4"], False, range(2, 2), save=f"{root}/b", load=f"{root}/a", bf16=True)
    _train("llama", LOADERS["tp4"], False, range(2, 2), save=f"{root}/c", load=f"{root}/b", bf16=True)


def test_bf16_masters_and_moments_survive_two_reshards_exactly(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(4, _bf16_roundtrip, str(root), tmp_dir=tmp_path)
    a, c = (sharded.load_full(sharded.iter_dir(root / x, 2)) for x in ("a", "c"))
    keys = [k for k in a if not k.startswith("rng.")]
    assert any(k.startswith("optimizer.fp32_param.") for k in keys)
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in keys)
    assert sorted(keys) == sorted(k for k in c if not k.startswith("rng."))
    for k in keys:
        assert a[k].dtype == c[k].dtype and torch.equal(a[k], c[k]), k
    assert a["model.decoder.layers.1.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    assert a["optimizer.fp32_param.decoder.layers.1.mlp.linear_fc1.weight"].dtype == torch.float32
    assert torch.count_nonzero(a["optimizer.exp_avg_sq.decoder.layers.1.mlp.linear_fc1.weight"]) > 0


def _same_layout_with_dropout(rank: int, world: int, root: str) -> tuple:
    """TP2 x PP2 with dropout: 4 steps straight, and 2 + save + load (fresh trainer) + 2."""
    def run(steps: range, **ckpt) -> list[float]:
        from paratron.train.loop import Trainer, build_dims
        cfg = tiny_config("llama", hidden_dropout=0.1, attention_dropout=0.1, use_distributed_optimizer=True, **SAVER,
                          train_iters=4, save=ckpt.get("save"), load=ckpt.get("load"))
        dims = build_dims(cfg)
        batches = micro_batches(global_batches(cfg, 4), cfg, dims.dp_rank, dims.dp)
        for _ in range(steps.start * cfg.train.global_batch_size // cfg.train.micro_batch_size):
            next(batches)
        t = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(batches, None))
        out = [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in steps)]
        if ckpt.get("save"):
            t.save()
        t.close()
        return out
    straight = run(range(4))
    resumed = run(range(2), save=root) + run(range(2, 4), load=root)
    return straight, resumed


def test_same_layout_resume_with_dropout_is_bit_exact(tmp_path):
    straight, resumed = run_ranks(4, _same_layout_with_dropout, str(tmp_path / "ck"), tmp_dir=tmp_path)[-1]
    assert straight == resumed and straight[0] == straight[0]


def _unshared_save(rank: int, world: int, root: str) -> str:
    """Each rank saves under its own directory, as on nodes with local disks."""
    from paratron.checkpoint.pieces import Piece
    t = torch.ones(4)
    try:
        sharded.save(f"{root}/node{rank}", 1, [Piece("x", (8,), (4 * rank,), t)], {})
    except sharded.CheckpointError as e:
        return str(e)
    return "saved"


def test_a_save_directory_not_shared_by_all_ranks_is_an_error(tmp_path):
    got = run_ranks(2, _unshared_save, str(tmp_path), tmp_dir=tmp_path)
    assert all("rank 1 does not see" in g and "every rank shares" in g for g in got), got
    assert not (tmp_path / "node0" / "latest_checkpointed_iteration.txt").exists()


def _checkpoint_group_backends(rank: int, world: int, root: str) -> dict:
    """The backend each run asks for its checkpoint group, and a resume from an asynchronous save made with
    --disable-gloo-process-groups (checkpoint collectives on the default backend's group: gloo here, NCCL on GPUs)."""
    import torch.distributed as dist
    asked = {}
    new_group = dist.new_group

    def recording(*args, **kwargs):
        if kwargs.get("group_desc") == "checkpoint":
            asked[len(asked)] = kwargs.get("backend")
        return new_group(*args, **kwargs)

    dist.new_group = recording
    try:
        from paratron.train.loop import Trainer, build_dims
        out = {}
        for step, (flag, load) in enumerate(((True, None), (True, f"{root}/ck"), (False, f"{root}/ck"))):
            cfg = tiny_config("gpt", use_distributed_optimizer=True, train_iters=4, save=f"{root}/ck", load=load,
                              async_save=True, disable_gloo_process_groups=flag)
            dims = build_dims(cfg)
            batches = micro_batches(global_batches(cfg, 4), cfg, dims.dp_rank, dims.dp)
            t = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(batches, None))
            out[step] = t.iteration
            t.train_step()
            t.save()
            t.close()
        return {"asked": asked, "iterations": out}
    finally:
        dist.new_group = new_group


def test_disable_gloo_process_groups_puts_checkpoints_on_the_default_backend(tmp_path):
    for r in run_ranks(2, _checkpoint_group_backends, str(tmp_path), tmp_dir=tmp_path):
        assert r["asked"] == {0: None, 1: None, 2: "gloo"}
        assert r["iterations"] == {0: 0, 1: 1, 2: 2}  # each run resumed from the previous one's (async) save
