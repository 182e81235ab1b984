"""parallel/turns.py's Turns: two parties take strict turns at each hand-off, the first starting; a finished party
hands the turn over for good (the other's hand-offs then return at once); an error in either is raised by run."""
from __future__ import annotations

import pytest

from paratron.parallel.turns import Turns


def test_parties_alternate_at_each_handoff():
    turns, log = Turns(), []

    def party(name, steps):
        def fn():
            for i in range(steps):
                log.append(f"{name}{i}")
                turns.handoff()
        return fn

    turns.run(party("f", 3), party("b", 5))
    # f0 | b0 | f1 | b1 | f2 | b2 ... then b alone once f has finished
    assert log == ["f0", "b0", "f1", "b1", "f2", "b2", "b3", "b4"]


def test_an_error_in_the_helper_party_is_raised_and_the_other_finishes():
    turns, log = Turns(), []

    def first():
        for i in range(3):
            log.append(i)
            turns.handoff()

    def second():
        raise ValueError("backward failed")

    with pytest.raises(ValueError, match="backward failed"):
        turns.run(first, second)
    assert log == [0, 1, 2]


BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--num-experts", "4",
        "--overlap-moe-expert-parallel-comm"]


@pytest.mark.parametrize("flags,world,match", [
    ([], 1, "needs --expert-model-parallel-size > 1"),
    (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"], 2,
     "use --moe-token-dispatcher-type alltoall or flex"),
    (["--expert-model-parallel-size", "2", "--moe-shared-expert-intermediate-size", "16",
      "--moe-shared-expert-overlap"], 2, "overlap the same all-to-all: remove one"),
    (["--expert-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], 2, "not supported with --recompute-granularity full"),
    (["--expert-model-parallel-size", "2", "--mtp-num-layers", "2"], 2, "at most one MTP layer"),
    (["--expert-model-parallel-size", "2", "--delay-wgrad-compute", "--moe-grouped-gemm", "--fp8-format", "hybrid"], 2,
     "--delay-wgrad-compute is not built for FP8 experts"),
    (["--expert-model-parallel-size", "2", "--delay-wgrad-compute"], 2, "--delay-wgrad-compute defers the experts' "
     "grouped GEMMs' weight gradients: set --moe-grouped-gemm"),
    (["--expert-model-parallel-size", "2", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
      "optim_grads_params"], 2, "ZeRO-3 gathers and frees each layer's parameters for one pass at a time"),
])
def test_the_flag_is_refused_where_it_cannot_work_in_one_line(flags, world, match):
    from paratron.config import ConfigError
    from paratron.config import parse_args
    with pytest.raises(ConfigError, match=match) as e:
        parse_args(BASE + flags, world_size=world)
    assert "\n" not in str(e.value)


def test_the_flag_is_taken_at_ep2():
    from paratron.config import parse_args
    assert parse_args(BASE + ["--expert-model-parallel-size", "2"], world_size=2).model.overlap_moe_expert_parallel_comm


def test_the_memory_plan_holds_two_micro_batches_activations_with_the_turns():
    """paratron plan / the start-up memory lines: the forward of one micro-batch runs while the previous one's
    activations wait for its backward, so two micro-batches' activations are held at once."""
    import dataclasses

    from paratron.plan.activations import in_flight
    from paratron.plan.layout import Layout
    plain = Layout(ep=2, dp=2, micro_batch=2, global_batch=12)
    assert in_flight(plain, 0) == 1
    assert in_flight(dataclasses.replace(plain, turns=True), 0) == 2
    assert in_flight(dataclasses.replace(plain, turns=True, global_batch=4), 0) == 1  # one micro-batch: no turns
    piped = Layout(pp=4, ep=2, dp=2, micro_batch=1, global_batch=16)  # 8 micro-batches
    assert [in_flight(piped, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(dataclasses.replace(piped, turns=True), r) for r in range(4)] == [5, 4, 3, 2]
    chunks = dataclasses.replace(piped, vpp=2)  # interleaved: chunk micro-batches, one more with the turns
    plain_chunks = [in_flight(chunks, r) for r in range(4)]
    assert [in_flight(dataclasses.replace(chunks, turns=True), r) for r in range(4)] == [n + 1 for n in plain_chunks]


def test_owed_weight_gradients_arrive_at_settle_through_autograd_bit_for_bit():
    """moe_wgrad.OwedWeightGrads (--delay-wgrad-compute): the backward gives the input gradient and leaves the
    weight's (nothing accumulated, no hook fired); settle delivers it through the weight's accumulator (its hook
    fires once, with the gradient), equal to autograd's own for torch._grouped_mm."""
    import torch

    from paratron.model.moe_wgrad import OwedWeightGrads
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(40, 16, dtype=dtype, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(4, 32, 16, dtype=dtype))
        ends, g = torch.tensor([8, 16, 32, 40], dtype=torch.int32), torch.randn(40, 32, dtype=dtype)
        torch._grouped_mm(a, w.transpose(1, 2), offs=ends).backward(g)
        want_a, want_w = a.grad.clone(), w.grad.clone()
        a.grad = w.grad = None
        hooked = []
        w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.clone()))
        owed = OwedWeightGrads()
        owed.mm(a, w, ends).backward(g)
        assert torch.equal(a.grad, want_a) and w.grad is None and not hooked and len(owed.owed) == 1
        owed.settle()
        assert torch.equal(w.grad, want_w) and len(hooked) == 1 and torch.equal(hooked[0], want_w)
        assert not owed.owed


def test_delay_wgrad_compute_needs_the_overlap_as_megatron():
    from paratron.config import ConfigError, parse_args
    flags = [f for f in BASE if f != "--overlap-moe-expert-parallel-comm"]
    with pytest.raises(ConfigError, match="--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"):
        parse_args(flags + ["--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--delay-wgrad-compute"],
                   world_size=2)


@pytest.mark.parametrize("extra, says", [
    (["--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm"], "exclude each other"),
    (["--expert-model-parallel-size", "1"], "needs --expert-model-parallel-size > 1"),
    (["--moe-token-dispatcher-type", "allgather"], "use --moe-token-dispatcher-type alltoall or flex"),
    (["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap"], "dispatch's backward all-to-all: "
     "remove one"),
    (["--fp8-format", "hybrid", "--bf16"], "is not built for FP8 experts"),
])
def test_the_dispatch_backward_overlap_is_refused_where_it_cannot_run(extra, says):
    """--overlap-dispatch-backward-with-experts-wgrad: Megatron's exclusions and paratron's needs, one line each."""
    from paratron.config import ConfigError, parse_args
    flags = [f for f in BASE if f != "--overlap-moe-expert-parallel-comm"]
    ok = flags + ["--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                  "--overlap-dispatch-backward-with-experts-wgrad"]
    assert parse_args(ok, world_size=2).model.overlap_dispatch_backward_with_experts_wgrad
    with pytest.raises(ConfigError, match="--overlap-dispatch-backward-with-experts-wgrad") as e:
        parse_args(ok + extra, world_size=2)
    assert says in str(e.value)


def test_the_time_plan_hides_the_expert_all_to_alls_under_the_other_micro_batch():
    """paratron plan's step time: with the turns the all-to-alls are exposed for one micro-batch only (when the
    compute covers the rest); with one micro-batch nothing is paired; nothing else changes."""
    import dataclasses

    from paratron.plan.cost import Cluster, step_time
    from paratron.plan.layout import Layout
    from paratron.plan.search import dp_bytes
    from tests.parallel.common import tiny_config
    model = tiny_config("llama", world_size=1, num_layers=4, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=32).model
    slow = Cluster(4, 1, "h100", inter_gbps=0.5)  # every GPU its own node: the all-to-alls cost
    plain = Layout(dp=4, ep=4, param_bytes=2, grad_bytes=4, micro_batch=1, global_batch=32, seq_length=32)  # 8 mbs
    turns = dataclasses.replace(plain, turns=True)
    a, b = (step_time(model, 512, L, slow, *dp_bytes(model, 512, L, {})) for L in (plain, turns))
    assert a.ep > 0 and b.ep < a.ep and b.ep >= a.ep / 8 - 1e-12
    assert {k: v for k, v in a.parts().items() if k != "ep"} == {k: v for k, v in b.parts().items() if k != "ep"}
    one = [dataclasses.replace(L, global_batch=4) for L in (plain, turns)]
    x, y = (step_time(model, 512, L, slow, *dp_bytes(model, 512, L, {})) for L in one)
    assert x.ep == y.ep
