"""--overlap-moe-expert-parallel-comm (parallel/turns.py) on gloo: each micro-batch's forward beside the previous
one's backward, taking turns at the expert all-to-alls, trains exactly as the plain schedule (same losses, same
parameters, bit for bit: the same arithmetic in the same order) at EP 2 with dropout on (the forwards draw their
random numbers in the plain order) and at TP 2 x EP 2 with sequence parallelism inside DP 2 with the distributed
optimizer's overlapped gradient reduction, PP 2 x EP 2 (1F1B's forwards and backwards paired in its
slots), and DP 4 x EP 2 under ZeRO-2; and the turns really change hands at the all-to-alls (counted)."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.parallel.common import run_steps, tiny_config

STEPS = 2
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
           moe_router_dtype="fp32", clip_grad=0.05, global_batch_size=12)
LAYOUTS = {  # name: (world, flags)
    "ep2_dropout": (2, dict(expert_model_parallel_size=2, hidden_dropout=0.1, attention_dropout=0.1)),
    "tp2_ep2_sp_distopt": (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True,
                                   use_distributed_optimizer=True, overlap_grad_reduce=True, global_batch_size=24)),
    # 1F1B: one more warm-up forward, then each stage's forward and backward of two micro-batches in one slot
    "pp2_ep2": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2, num_layers=4,
                        global_batch_size=20)),
    # ZeRO-2: gradients reduce-scattered into shards (the last micro-batch's backward, alone)
    "dp4_ep2_zero2": (4, dict(expert_model_parallel_size=2, use_megatron_fsdp=True,
                              data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True,
                              global_batch_size=24)),
}


def _run(rank: int, world: int, flags: dict) -> dict:
    from paratron.parallel import turns
    handoffs = []  # the party that passed the turn, where the other one was still running
    original = turns.Turns.handoff

    def counted(self):
        if self._running[1 - self._turn]:
            handoffs.append(self._turn)
        original(self)

    from tests.parallel.test_sharded_dp import train as sharded_train
    run = sharded_train if flags.get("use_megatron_fsdp") else run_steps  # (gathers the sharded parameters)
    plain = run(tiny_config("llama", world, **{**MOE, **flags}), STEPS)
    turns.Turns.handoff = counted
    try:
        combined = run(tiny_config("llama", world, **{**MOE, **flags}, overlap_moe_expert_parallel_comm=True), STEPS)
    finally:
        turns.Turns.handoff = original
    return {"plain": plain, "combined": combined, "handoffs": (handoffs.count(0), handoffs.count(1))}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_taking_turns_at_the_all_to_alls_trains_as_the_plain_schedule(name, tmp_path):
    world, flags = LAYOUTS[name]
    for out in run_ranks(world, _run, flags, tmp_dir=tmp_path):
        # (a pipeline stage before the last has no loss: nan on both)
        assert all(a == b or a != a and b != b for a, b in zip(out["plain"]["losses"], out["combined"]["losses"]))
        for n, p in out["plain"]["params"].items():
            assert torch.equal(p, out["combined"]["params"][n]), n
        # the forward (party 0) and the backward (party 1, whose all-to-alls run under a later pair of turns than
        # the forward that built them) both pass the turn at their all-to-alls
        forward, backward = out["handoffs"]
        assert forward >= STEPS * 2 and backward >= STEPS * 2, out["handoffs"]
