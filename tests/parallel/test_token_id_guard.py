"""Token ids beyond the vocabulary stop the run with one line on every rank, at TP2 (where each
rank's vocabulary shard would mask them and train on zeros) and at TP1 (a raw IndexError before),
whatever the data path: the batches here come straight from an iterator, past any dataset check.
--no-token-id-check turns the guard off."""
import pytest
import torch

from paratron.errors import DataError, UserError
from tests.dist import run_ranks
from tests.parallel.common import VOCAB, global_batches, micro_batches, tiny_config

BAD_ID = VOCAB + 88  # inside the padded table of neither rank


def _bad_batches(cfg, dp_rank, dp):
    samples = global_batches(cfg, 2)
    samples[cfg.train.global_batch_size]["tokens"][5] = BAD_ID  # in the second step
    return micro_batches(samples, cfg, dp_rank, dp)


def _steps(rank, world, *flags):
    from paratron.train.loop import Trainer, build_dims
    cfg = tiny_config(tensor_model_parallel_size=world, **{f: True for f in flags})
    dims = build_dims(cfg)
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(_bad_batches(cfg, dims.dp_rank, dims.dp), None))
    try:
        done = 0
        for _ in range(2):
            trainer.train_step()
            done += 1
    except DataError as e:
        return {"error": str(e), "steps": done}
    finally:
        trainer.close()
    return {"error": None, "steps": done}


def test_tp2_every_rank_stops_with_one_line(tmp_path):
    for r in run_ranks(2, _steps, tmp_dir=tmp_path):
        assert r["steps"] == 1 and r["error"] is not None and "\n" not in r["error"], r
        assert f"id {BAD_ID} is outside the vocabulary of {VOCAB} ids" in r["error"], r
        assert "--no-token-id-check" in r["error"]
    assert issubclass(DataError, UserError)  # the command line prints it as one line, exit 2


def test_tp1_stops_with_the_same_line():
    r = _steps(0, 1)
    assert r["steps"] == 1 and f"id {BAD_ID} is outside the vocabulary of {VOCAB} ids" in r["error"]


def test_the_flag_turns_the_guard_off():
    with pytest.raises(IndexError):  # TP1 without the guard: the raw lookup error of before (TP2 trained on)
        _steps(0, 1, "no_token_id_check")


def test_the_embedding_checks_host_ids_itself():
    from paratron.parallel.tensor import VocabParallelEmbedding
    emb = VocabParallelEmbedding(64, 8)
    with pytest.raises(DataError, match="id 64 is outside the vocabulary of 64 ids"):
        emb(torch.tensor([[1, 64]]))
    emb.check_ids = False
    with pytest.raises(IndexError):
        emb(torch.tensor([[1, 64]]))
