"""--overlap-moe-expert-parallel-comm (parallel/turns.py) on gloo: each micro-batch's forward beside the previous
one's backward, taking turns at the expert all-to-alls, trains exactly as the plain schedule (same losses, same
parameters, bit for bit: the same arithmetic in the same order) at EP 2 with dropout on (the forwards draw their
random numbers in the plain order) and at TP 2 x EP 2 with sequence parallelism inside DP 2 with the distributed
optimizer's overlapped gradient reduction, PP 2 x EP 2 (1F1B's forwards and backwards paired in its
slots) and with 2 virtual stages a rank (interleaved), the same and EP 2 with the experts' weight gradients delayed (--delay-wgrad-compute, under the
distributed optimizer's overlapped reduction), and DP 4 x EP 2 under ZeRO-2; and the turns really change hands at the all-to-alls (counted)."""
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
    # interleaved 1F1B (2 virtual stages a rank): the same pairing over the chunks
    "pp2_vpp2_ep2": (4, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                             expert_model_parallel_size=2, num_layers=4, global_batch_size=24)),
    # --delay-wgrad-compute: the experts' weight gradients computed under the dispatch's backward all-to-all
    "ep2_delay_wgrad": (2, dict(expert_model_parallel_size=2, delay_wgrad_compute=True)),
    "pp2_ep2_delay_wgrad": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2, num_layers=4,
                                    global_batch_size=20, delay_wgrad_compute=True, overlap_grad_reduce=True,
                                    use_distributed_optimizer=True)),
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

    from paratron.model import moe_wgrad
    from tests.parallel.test_sharded_dp import train as sharded_train
    settled, settle = [], moe_wgrad.OwedWeightGrads.settle

    def counted_settle(self):
        settled.append(len(self.owed))
        settle(self)
    moe_wgrad.OwedWeightGrads.settle = counted_settle
    # (sharded_train gathers sharded parameters and takes every model chunk of a rank)
    run = sharded_train if flags.get("use_megatron_fsdp") or flags.get("num_layers_per_virtual_pipeline_stage") \
        else run_steps
    plain = run(tiny_config("llama", world, **{**MOE, **{k: v for k, v in flags.items() if k != "delay_wgrad_compute"}}),
                STEPS)
    turns.Turns.handoff = counted
    try:
        combined = run(tiny_config("llama", world, **{**MOE, **flags}, overlap_moe_expert_parallel_comm=True), STEPS)
    finally:
        turns.Turns.handoff = original
        moe_wgrad.OwedWeightGrads.settle = settle
    return {"plain": plain, "combined": combined, "handoffs": (handoffs.count(0), handoffs.count(1)),
            "settled": sum(settled)}


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
        # --delay-wgrad-compute: fc1's and fc2's weight gradients owed, then settled, in every MoE layer's backward
        assert (out["settled"] >= STEPS * 2 * 2) == bool(flags.get("delay_wgrad_compute")), out["settled"]


def _facade(rank: int, world: int) -> dict:
    """Megatron Core's names: TransformerConfig(overlap_moe_expert_parallel_comm=...) and get_forward_backward_func,
    at EP 2; the gradients of 3 micro-batches with and without the flag, and the effective hand-offs."""
    from paratron.core import parallel_state
    from paratron.core.models.gpt import GPTModel
    from paratron.core.pipeline_parallel import get_forward_backward_func
    from paratron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from paratron.core.transformer import TransformerConfig
    from paratron.parallel import turns
    from tests.parallel.test_core_facade import SEQ, VOCAB, batches, forward_step
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    handoffs, original = [], turns.Turns.handoff

    def counted(self):
        handoffs.append(self._running[1 - self._turn])
        original(self)

    grads = {}
    turns.Turns.handoff = counted
    try:
        for flag in (False, True):
            model_parallel_cuda_manual_seed(123)
            cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                    attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2,
                                    moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
                                    overlap_moe_expert_parallel_comm=flag)
            model = GPTModel(config=cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches(3)), model=model,
                                        num_microbatches=3, seq_length=SEQ, micro_batch_size=2)
            grads[flag] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        refused = _facade_refusals(cfg, model)
    finally:
        turns.Turns.handoff = original
        parallel_state.destroy_model_parallel()
    return {"grads": grads, "handoffs": sum(handoffs), "refused": refused}


def _facade_refusals(cfg, model) -> list[str]:
    """What the facade refuses beside the turns (config/check_moe.py's rules, checked where the facade learns each
    choice): the shared expert's own overlap and full recomputation at the model, ZeRO-3 at the DDP wrapper."""
    import dataclasses
    from paratron.config import ConfigError
    from paratron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from paratron.core.models.gpt import GPTModel
    from tests.parallel.test_core_facade import SEQ, VOCAB
    out = []
    for change in (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
                   dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        try:
            GPTModel(config=dataclasses.replace(cfg, **change), vocab_size=VOCAB, max_sequence_length=SEQ)
        except ConfigError as e:
            out.append(str(e))
    zero3 = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                          data_parallel_sharding_strategy="optim_grads_params")
    try:
        DistributedDataParallel(config=cfg, ddp_config=zero3, module=model)
    except ConfigError as e:
        out.append(str(e))
    return out


def test_the_core_facade_takes_the_turns_from_the_transformer_config(tmp_path):
    for out in run_ranks(2, _facade, tmp_dir=tmp_path):
        plain, combined = out["grads"][False], out["grads"][True]
        assert plain.keys() == combined.keys() and any("experts" in n for n in plain)
        for n in plain:
            assert torch.equal(plain[n], combined[n]), n
        assert out["handoffs"] > 0
        refused = out["refused"]
        assert len(refused) == 3, refused
        assert "--moe-shared-expert-overlap" in refused[0] and "recompute-granularity full" in refused[1]
        assert "optim_grads_params" in refused[2]


def _dispatch_backward(rank: int, world: int, flags: dict) -> dict:
    """The plain run and the one with --overlap-dispatch-backward-with-experts-wgrad; each settle of owed weight
    gradients recorded with what it held and whether an all-to-all was in flight (inside the dispatch's turn)."""
    from paratron.model import moe_wgrad
    from paratron.parallel import experts
    settled, settle, exchange = [], moe_wgrad.OwedWeightGrads.settle, experts._exchange
    in_flight = []

    def counted_settle(self):
        settled.append((len(self.owed), bool(in_flight)))
        settle(self)

    def flagged_exchange(x, out_splits, in_splits, group, turn):
        if turn is None:
            return exchange(x, out_splits, in_splits, group, turn)

        def marked():
            in_flight.append(True)
            try:
                turn()
            finally:
                in_flight.pop()
        return exchange(x, out_splits, in_splits, group, marked)
    plain = run_steps(tiny_config("llama", world, **MOE, **flags), STEPS)
    moe_wgrad.OwedWeightGrads.settle, experts._exchange = counted_settle, flagged_exchange
    try:
        overlapped = run_steps(tiny_config("llama", world, **MOE, **flags,
                                           overlap_dispatch_backward_with_experts_wgrad=True), STEPS)
    finally:
        moe_wgrad.OwedWeightGrads.settle, experts._exchange = settle, exchange
    return {"plain": plain, "overlapped": overlapped, "settled": settled}


@pytest.mark.parametrize("flags", [dict(expert_model_parallel_size=2),
                                   dict(expert_model_parallel_size=2, moe_permute_fusion=True)])
def test_experts_wgrad_under_the_dispatch_backward_trains_as_the_plain_backward(flags, tmp_path):
    """--overlap-dispatch-backward-with-experts-wgrad (Megatron's flag, without the turns): each MoE layer's experts'
    weight gradients are computed while the dispatch's backward all-to-all is in flight, and the run is the plain
    run bit for bit."""
    for out in run_ranks(2, _dispatch_backward, flags, tmp_dir=tmp_path):
        assert out["plain"]["losses"] == out["overlapped"]["losses"]
        for n, p in out["plain"]["params"].items():
            assert torch.equal(p, out["overlapped"]["params"][n]), n
        owed = [n for n, flying in out["settled"] if n]
        # fc1's and fc2's weight gradients of each of the 2 MoE layers, each micro-batch of each step: all settled
        # while an all-to-all was in flight
        assert len(owed) >= STEPS * 2 and all(n == 2 for n in owed), out["settled"]
        assert all(flying for n, flying in out["settled"] if n), out["settled"]
