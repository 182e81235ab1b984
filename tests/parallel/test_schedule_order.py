"""The order of forwards and backwards on each rank: 1F1B and interleaved 1F1B, checked against tables
written out by hand, and through real gloo ranks running a deterministic fake stage that records
what it runs, routes micro-batches through the virtual stages and computes a known loss and gradient.
Also: a stage whose peer stops answering fails within the timeout, naming the peer."""
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratron.parallel.pipeline import action_parts, build_plan, interleaved_warmup, schedule_table
from tests.dist import run_ranks


def parse(text: str) -> list[tuple]:
    """'F0 B0' -> [("F", 0, 0), ("B", 0, 0)]; 'F1.2' is chunk 1, micro-batch 2."""
    out = []
    for tok in text.split():
        chunk, mb = tok[1:].split(".") if "." in tok else ("0", tok[1:])
        out.append((tok[0], int(chunk), int(mb)))
    return out


# Written out by hand from Megatron's rules (megatron_facts.md section 6): 1F1B warms up with
# PP - rank - 1 forwards; interleaved with 2 (PP - rank - 1) + (V - 1) PP, all forwards when
# micro-batches = PP, forward k being chunk (k // PP) % V of micro-batch (k // (PP V)) PP + k % PP.
TABLES = {
    ("1f1b", 4, 1, 6): ["F0 F1 F2  F3 B0 F4 B1 F5 B2  B3 B4 B5",
                        "F0 F1  F2 B0 F3 B1 F4 B2 F5 B3  B4 B5",
                        "F0  F1 B0 F2 B1 F3 B2 F4 B3 F5 B4  B5",
                        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
    ("1f1b", 4, 1, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
    ("interleaved", 2, 2, 4): [
        "F0.0 F0.1 F1.0 F1.1  F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1  B1.2 B1.3 B0.2 B0.3",
        "F0.0 F0.1  F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3  B0.2 B0.3"],
    ("interleaved", 2, 2, 2): ["F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1"] * 2,
}


# --microbatch-group-size-per-virtual-pipeline-stage G (Megatron's order: micro-batches in groups of G,
# the last group taking the rest, each group through chunk 0 then chunk 1; the backwards in the same
# order with the chunks reversed; warm-up 2 (PP - rank - 1) + (V - 1) G). PP 2, V 2, 5 micro-batches,
# G 3 is Megatron's docstring example: forwards (micro-batch, chunk) 0 1 2 0 1 2 3 4 3 4 / 0 0 0 1 1 1 0 0 1 1.
GROUP_TABLES = {
    (2, 2, 5, 3): ["F0.0 F0.1 F0.2 F1.0 F1.1  F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1  "
                   "B0.2 B1.3 B1.4 B0.3 B0.4",
                   "F0.0 F0.1 F0.2  F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F0.3 B0.0 F0.4 B0.1 F1.3 B0.2 F1.4 B1.3  "
                   "B1.4 B0.3 B0.4"],
}


@pytest.mark.parametrize("key", list(TABLES))
def test_tables_match_hand_written(key):
    _, pp, vpp, m = key
    for rank, text in enumerate(TABLES[key]):
        assert schedule_table(pp, vpp, rank, m) == parse(text), f"rank {rank}"


def test_group_tables_match_hand_written():
    for (pp, vpp, m, group), texts in GROUP_TABLES.items():
        for rank, text in enumerate(texts):
            assert schedule_table(pp, vpp, rank, m, group=group) == parse(text), f"rank {rank}"
    for m in (4, 8):  # G = PP is the default schedule
        assert all(schedule_table(2, 2, r, m, group=2) == schedule_table(2, 2, r, m) for r in range(2))
    assert [interleaved_warmup(4, 2, r, 16, group=8) for r in range(4)] == [14, 12, 10, 8]
    plan = build_plan(2, 2, 5, False, 3)
    assert [[s.action for s in slots if s.action] for slots in plan] == [parse(t) for t in GROUP_TABLES[(2, 2, 5, 3)]]


@pytest.mark.parametrize("flags,message", [
    (["--microbatch-group-size-per-virtual-pipeline-stage", "2"], "needs virtual pipeline stages"),
])
def test_group_flag_needs_interleaving(flags, message):
    from paratron.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match=message):
        parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", *flags])


@pytest.mark.parametrize("m,group,message", [
    (8, 1, "must be between --pipeline-model-parallel-size 2 and the micro-batches per step \\(8\\)"),
    (4, 6, "must be between"),
    (7, 3, "leave a last group of 1"),
    (5, None, "to be a multiple of --pipeline-model-parallel-size 2"),
])
def test_group_sizes_checked_against_the_step(m, group, message):
    from paratron.config import ConfigError
    from paratron.parallel.dims import ParallelDims
    from paratron.parallel.pipeline import check_pipeline_schedule
    with pytest.raises(ConfigError, match=message):
        check_pipeline_schedule(ParallelDims(pp=2, vpp=2, vpp_group=group), m)
    check_pipeline_schedule(ParallelDims(pp=2, vpp=2, vpp_group=3), 5)  # 5 mod 3 = 2 >= PP: accepted


def test_warmup_counts():
    for pp in (2, 4, 8):
        for rank in range(pp):
            for m in (1, pp, 3 * pp):
                first_b = [a[0] for a in schedule_table(pp, 1, rank, m)].index("B")
                assert first_b == min(pp - rank - 1, m) + (1 if pp - rank - 1 < m else 0)
    assert [interleaved_warmup(4, 2, r, 8) for r in range(4)] == [10, 8, 6, 4]
    assert [interleaved_warmup(4, 3, r, 8) for r in range(4)] == [14, 12, 10, 8]
    assert interleaved_warmup(4, 2, 3, 4) == 8  # micro-batches = PP: all forwards first


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 1), (3, 1, 5), (4, 1, 16), (2, 2, 2), (2, 3, 6), (4, 2, 8),
                                      (4, 4, 12), (8, 2, 16)])
def test_plan_pairs_every_transfer_in_its_slot(pp, vpp, m):
    """Each rank runs its table; in the slot where virtual stage s runs F (B) of micro-batch mb, the
    rank of stage s+1 (s-1) receives exactly that micro-batch's activation (gradient), and uses it
    in a later slot."""
    last = pp * vpp - 1
    # turns (--overlap-moe-expert-parallel-comm): each steady-state F and the B after it share one slot ("FB")
    for forward_only, turns in ((False, False), (True, False), (False, True)):
        plan = build_plan(pp, vpp, m, forward_only, None, turns)
        at = [{s.t: s for s in slots} for slots in plan]
        used = {}  # (kind, stage, mb) -> slot
        for rank, slots in enumerate(plan):
            table = schedule_table(pp, vpp, rank, m, forward_only, None, turns)
            assert [s.action for s in slots if s.action] == table
            parts = [p for a in table for p in action_parts(a)]
            # the same actions, forwards and backwards each in their plain order (with the turns one forward
            # earlier: one more warm-up forward), each steady-state pair of two micro-batches
            plain = schedule_table(pp, vpp, rank, m, forward_only)
            assert [a for a in parts if a[0] == "F"] == [a for a in plain if a[0] == "F"]
            assert [a for a in parts if a[0] == "B"] == [a for a in plain if a[0] == "B"]
            assert all(a[1][1] != a[2][1] for a in table if a[0] == "FB")
            assert turns or not any(a[0] == "FB" for a in table)
            assert [s.t for s in slots] == sorted({s.t for s in slots})
            for s in slots:
                for kind, c, mb in (action_parts(s.action) if s.action else []):
                    used[(kind, c * pp + rank, mb)] = s.t
        transfers = 0
        for (kind, stage, mb), t in used.items():
            dest = stage + 1 if kind == "F" else stage - 1
            if not 0 <= dest <= last:
                continue
            transfers += 1
            got = at[dest % pp][t]
            assert (got.recv_act if kind == "F" else got.recv_grad) == (dest // pp, mb)
            assert used[(kind, dest, mb)] > t
        paired = sum(1 for slots in plan for s in slots if s.action and s.action[0] == "FB")
        assert (paired > 0) == (turns and m > pp), paired  # a steady state exists once the micro-batches exceed PP
        received = sum(1 for slots in plan for s in slots for x in (s.recv_act, s.recv_grad) if x)
        assert received == transfers == last * m * (1 if forward_only else 2)


# ---- real ranks with a fake stage -------------------------------------------------------------------
SEQ, MBS, HIDDEN = 4, 1, 8


def fake_layout():
    from paratron.parallel.layout import BatchLayout
    return BatchLayout(micro_batch_size=MBS, seq_length=SEQ, hidden_size=HIDDEN)


class FakeStage(nn.Module):
    """Virtual stage s computes y = x * w_s + s and logs what runs on it."""

    def __init__(self, stage: int, chunk: int, log: list):
        super().__init__()
        self.stage, self.chunk, self.log = stage, chunk, log
        self.w = nn.Parameter(torch.tensor(1.0 + 0.1 * stage))
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x0, mb):
        x = x0 if self.stage == 0 else self.input_tensor
        self.log.append(("F", self.chunk, mb))
        y = x * self.w + self.stage
        if y.requires_grad:
            y.register_hook(lambda g: self.log.append(("B", self.chunk, mb)))
        return y


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    y = model(batch["x"], batch["mb"])

    def loss_func(out):
        total = 0.5 * (out.float() ** 2).sum()
        n = torch.tensor(float(out.numel()))
        return total, n, {"lm loss": torch.stack([total.detach(), n]), "mb": batch["mb"]}
    return y, loss_func


def expected(pp: int, vpp: int, m: int):
    """Per micro-batch loss sums and d(loss)/d(w_s) of the chain, in closed form."""
    stages = pp * vpp
    w = [1.0 + 0.1 * s for s in range(stages)]
    losses, grads = [], [0.0] * stages
    for mb in range(m):
        xs = [float(mb)]
        for s in range(stages):
            xs.append(xs[-1] * w[s] + s)
        losses.append(0.5 * xs[-1] ** 2 * SEQ * MBS * HIDDEN)
        g = xs[-1] / m  # d(loss / numel / m)/dy per element, summed over the elements below
        for s in reversed(range(stages)):
            grads[s] += g * xs[s]
            g *= w[s]
    return losses, grads


def _order_rank(rank, world, vpp, m, timeout=60.0, group=None):
    from paratron.parallel.dims import initialize_model_parallel
    from paratron.parallel.pipeline import get_forward_backward_func
    dims = initialize_model_parallel(1, world, vpp if vpp > 1 else None)
    dims.vpp_group = group
    out = {}
    for forward_only in (False, True):
        log = []
        chunks = [FakeStage(c * world + rank, c, log) for c in range(vpp)]
        data = [{"x": torch.full((SEQ, MBS, HIDDEN), float(i)), "mb": i} for i in range(m)]
        schedule = get_forward_backward_func(dims, timeout)
        with torch.set_grad_enabled(not forward_only):
            reports = schedule(forward_step_func=forward_step, data_iterator=iter(data), model=chunks,
                               num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, layout=fake_layout(),
                               forward_only=forward_only)
        out[forward_only] = {"log": log, "losses": [(r["mb"], r["lm loss"][0].item()) for r in reports],
                             "grads": {c.stage: (c.w.grad.item() if c.w.grad is not None else None) for c in chunks}}
    return out


@pytest.mark.parametrize("key", [("1f1b", 4, 1, 6), ("interleaved", 2, 2, 4), ("grouped", 2, 2, 5, 3)])
def test_ranks_run_the_table_and_route_every_tensor(tmp_path, key):
    pp, vpp, m = key[1:4]
    group = key[4] if len(key) > 4 else None
    results = run_ranks(pp, _order_rank, vpp, m, 60.0, group, tmp_dir=tmp_path)
    losses, grads = expected(pp, vpp, m)
    for rank, r in enumerate(results):
        train, fwd = r[False], r[True]
        table = GROUP_TABLES[key[1:]] if group else TABLES[key]
        assert train["log"] == parse(table[rank]), f"rank {rank}"
        assert fwd["log"] == [a for a in schedule_table(pp, vpp, rank, m, True, group)], f"rank {rank} forward-only"
        assert [a for a in fwd["log"] if a[0] == "B"] == []
        for stage, g in train["grads"].items():
            assert g == pytest.approx(grads[stage], rel=1e-5), f"stage {stage}"
        for run in (train, fwd):
            if rank == pp - 1:  # the last virtual stage is on the last rank
                assert [mb for mb, _ in run["losses"]] == list(range(m))
                assert [v for _, v in run["losses"]] == pytest.approx(losses, rel=1e-5)
            else:
                assert run["losses"] == []


def _stuck_peer_rank(rank, world):
    """Rank 0 runs one step, then stops answering; rank 1 must give up naming rank 0."""
    from paratron.parallel.dims import initialize_model_parallel
    from paratron.parallel.pipeline import get_forward_backward_func
    dims = initialize_model_parallel(1, 2)
    schedule = get_forward_backward_func(dims, p2p_timeout=3.0)
    chunk = FakeStage(rank, 0, [])
    data = [{"x": torch.zeros(SEQ, MBS, HIDDEN), "mb": i} for i in range(4)]
    for step in range(2):
        if rank == 0 and step == 1:
            time.sleep(60)  # stuck (the test fails rank 1 long before)
        start = time.time()
        schedule(forward_step_func=forward_step, data_iterator=iter(data), model=[chunk], num_microbatches=4,
                 seq_length=SEQ, micro_batch_size=MBS, layout=fake_layout())
    return time.time() - start


def test_stuck_peer_fails_within_timeout_naming_it(tmp_path):
    start = time.time()
    with pytest.raises(AssertionError) as e:
        run_ranks(2, _stuck_peer_rank, tmp_dir=tmp_path)
    msg = str(e.value)
    assert "PipelineError: pipeline stage 1 (rank 1): timed out after 3 s receiving an activation from rank 0" in msg
    assert time.time() - start < 45


def test_wrong_shape_is_an_error_on_the_sender():
    from paratron.parallel.dims import ParallelDims
    from paratron.parallel.p2p import P2P, PipelineError
    p2p = P2P(ParallelDims(world_size=2, pp=2, group_ranks={"pp": [0, 1]}), fake_layout().p2p_specs(), "cpu")
    with pytest.raises(PipelineError, match=r"stage 0 \(rank 0\) would send an activation of shape \(4, 2, 8\)"):
        p2p.exchange(send_act=[torch.zeros(SEQ, 2, HIDDEN)])
    with pytest.raises(PipelineError, match="torch.bfloat16"):
        p2p.exchange(send_grad=[torch.zeros(SEQ, MBS, HIDDEN, dtype=torch.bfloat16)])
    with pytest.raises(PipelineError, match="would send 2 activation tensor"):
        p2p.exchange(send_act=[torch.zeros(SEQ, MBS, HIDDEN)] * 2)


def test_the_flag_reaches_the_schedule(monkeypatch):
    """build_dims carries --microbatch-group-size-per-virtual-pipeline-stage to the schedule's dims."""
    from paratron.config import parse_args
    from paratron.parallel.dims import ParallelDims
    from paratron.train import distributed
    monkeypatch.setattr(distributed, "initialize_model_parallel", lambda *a, **k: ParallelDims(pp=2, vpp=2))
    cfg = parse_args(["--config", "tiny", "--mock-data", "--train-iters", "1", "--num-layers", "4",
                      "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                      "--microbatch-group-size-per-virtual-pipeline-stage", "4"], world_size=2)
    assert distributed.build_dims(cfg).vpp_group == 4
