"""The planner's model-state arithmetic where the config cannot be run yet (ZeRO-2/3 and optimizer offload, by
their semantics: tests/parallel/test_plan_state.py compares the strategies paratron runs with the tensors), and
the layout search's invariants."""
import pytest

from paratron.plan.cost import Cluster, step_time
from paratron.plan.layout import Layout
from paratron.plan.memory import rank_memory
from paratron.plan.search import dp_bytes
from paratron.plan.state import lay_out
from paratron.plan.shapes import Tensor
from tests.parallel.common import tiny_config

MODEL = tiny_config("llama", world_size=1, num_layers=4).model
BASE = Layout(dp=4, param_bytes=2, grad_bytes=4, micro_batch=1, global_batch=8, seq_length=32)


def state_of(**changes):
    return rank_memory(MODEL, 512, BASE.replace(**changes), 0)


def test_shards_cover_the_buffer_once():
    tensors = [Tensor(f"t{i}", n) for i, n in enumerate([1000, 64, 3, 70000, 129, 5000])]
    for n, bucket in ((1, None), (4, None), (3, 6000), (8, 100)):
        buf = lay_out(tensors, "dp_cp", n, bucket)
        assert sum(buf.shard_elems) == buf.numel == sum(t.numel for t in tensors)
        assert buf.total % (64 * n) == 0 and sum(buf.shard_pieces) >= len(tensors)


def test_each_zero_stage_shards_one_more_kind_of_state():
    zero = {s: state_of(sharding=s) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
    assert zero["optim"].optimizer == pytest.approx(zero["no_shard"].optimizer / 4, rel=0.05)
    assert zero["optim"].grads == zero["no_shard"].grads and zero["optim_grads"].grads == zero["optim"].grads // 4
    assert zero["optim_grads"].weights == zero["optim"].weights
    # (ZeRO-3's buckets end at each layer, so a little more padding than ZeRO-1's quarter)
    assert zero["optim_grads_params"].weights == pytest.approx(zero["optim"].weights / 4, rel=0.02)
    assert zero["optim_grads_params"].comm > zero["optim_grads"].comm > zero["optim"].comm  # bucket, gathered layer


def test_offload_moves_the_optimizer_state_to_the_host():
    kept, moved = state_of(sharding="optim"), state_of(sharding="optim", offload_fraction=1.0)
    assert moved.optimizer == 0 and moved.host >= kept.optimizer and moved.peak < kept.peak
    half = state_of(sharding="optim", offload_fraction=0.5)
    assert half.optimizer == pytest.approx(kept.optimizer / 2, abs=1)


def test_recomputation_and_micro_batch_move_activations_the_right_way():
    none, sel, full = (state_of(recompute=r).activations for r in (None, "selective", "full"))
    assert full < sel < none
    assert state_of(micro_batch=2).activations == 2 * state_of(micro_batch=1).activations


def test_more_exposed_communication_is_slower():
    cluster = Cluster(4, 4, "h100")
    layouts = [BASE.replace(sharding=s) for s in ("optim", "optim_grads_params")]
    times = [step_time(MODEL, 512, L, cluster, *dp_bytes(MODEL, 512, L, {})) for L in layouts]
    assert times[1].dp >= times[0].dp and times[0].compute == times[1].compute
    slow = Cluster(4, 1, "h100", inter_gbps=0.001)  # every GPU its own node, a slow network
    assert step_time(MODEL, 512, layouts[0], slow, *dp_bytes(MODEL, 512, layouts[0], {})).dp > times[0].dp


def test_recomputed_modules_cost_their_forward():
    """--recompute-modules mlp: the dense MLPs' forward FLOPs again, at the matmul peak; without core_attn the
    attention core is not recomputed; layernorm (elementwise) adds no FLOPs."""
    from paratron.plan.cost import recomputed_flops
    cluster = Cluster(1, 1, "h100")
    sel = BASE.replace(recompute="selective", recompute_modules=("core_attn",))
    mlp = sel.replace(recompute_modules=("core_attn", "mlp"))
    times = [step_time(MODEL, 512, L, cluster, *dp_bytes(MODEL, 512, L, {})).recompute for L in (sel, mlp)]
    tokens = BASE.global_batch * BASE.seq_length
    e = 3 if MODEL.swiglu else 2
    want = MODEL.num_layers * 2 * MODEL.hidden_size * MODEL.ffn_hidden_size * e * tokens
    assert recomputed_flops(MODEL, mlp, BASE.global_batch, BASE.seq_length) == want
    peak = cluster.peak(False) * cluster.matmul_efficiency
    assert times[1] - times[0] == pytest.approx(want / peak / BASE.world)
    layernorm = sel.replace(recompute_modules=("layernorm",))
    assert step_time(MODEL, 512, layernorm, cluster, *dp_bytes(MODEL, 512, layernorm, {})).recompute == 0.0


def test_activation_offloading_costs_the_copies_its_compute_cannot_hide():
    """--fine-grained-activation-offloading in the time model: each micro-batch's offloaded bytes go to the host
    under the forward (a third of the compute) and come back under the backward (two thirds); only the excess shows,
    so a fast host link hides them and a slow one exposes (2 x copy - compute) per micro-batch."""
    from paratron.plan.activations import offload_points, offloaded_bytes
    from paratron.plan.cost import GB
    from paratron.plan.shapes import layer_kinds
    L = BASE.replace(dp=1, global_batch=4, offload_modules=("attn_norm", "qkv_linear", "core_attn", "mlp_norm"),
                     min_offloaded_tensor_size=1)
    plain = BASE.replace(dp=1, global_batch=4)
    fast, slow = Cluster(1, 1, "h100", host_gbps=1e6), Cluster(1, 1, "h100", host_gbps=1e-3)
    bytes_ = dp_bytes(MODEL, 512, L, {})
    assert step_time(MODEL, 512, plain, slow, *bytes_).offload == 0.0
    assert step_time(MODEL, 512, L, fast, *bytes_).offload == 0.0
    t = step_time(MODEL, 512, L, slow, *bytes_)
    kinds = layer_kinds(MODEL)
    moved = sum(offloaded_bytes(MODEL, L, k, p, L.micro_batch * L.seq_length)
                for k, p in zip(kinds, offload_points(MODEL, L, kinds)))
    copy, m, busy = moved / (1e-3 * GB), 4, t.compute + t.memory + t.recompute
    assert moved > 0 and t.offload == pytest.approx(m * (2 * copy - busy / m))


def test_recurrent_layers_cp_all_to_alls_are_counted():
    """Under context parallelism a Mamba-2 layer's all-to-alls (x, B, C, dt out to the whole sequence, the output
    back; forward and backward) add to the step's cp time, by hand here; without CP there are none."""
    from paratron.plan.cost import GB
    hybrid = tiny_config("gpt", world_size=1, hybrid_layer_pattern="M-M-", hidden_size=64, num_attention_heads=4,
                         mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8, position_embedding_type="none",
                         normalization="RMSNorm").model
    cluster = Cluster(2, 2, "h100")
    L = BASE.replace(dp=1, cp=2, global_batch=2, seq_length=64)
    t = step_time(hybrid, 512, L, cluster, *dp_bytes(hybrid, 512, L, {}))
    heads, inner = 8, 128  # 2 x 64 / 16 heads of 16
    per_layer = (inner + 2 * 2 * 8 + heads) + inner  # out: x, B, C, dt; back: the output
    tokens, m = 1 * 64 // 2, 2
    want = 2 * (1 / 2) * tokens * 2 * 2 * per_layer * m / (cluster.intra_gbps or cluster.spec()[3]) / GB
    assert t.cp == pytest.approx(want)
    one = BASE.replace(dp=2, global_batch=2, seq_length=64)
    assert step_time(hybrid, 512, one, cluster, *dp_bytes(hybrid, 512, one, {})).cp == 0.0


def test_the_search_splits_recurrent_heads_and_groups_evenly_over_tp_and_cp():
    """Mamba-2 heads and groups (and Gated DeltaNet key heads) are cut over TP x CP: the search offers no layout
    that does not divide them (the config refuses those)."""
    from paratron.plan.search import parallel_shapes, recurrent_split
    hybrid = tiny_config("gpt", world_size=1, hybrid_layer_pattern="M*", hidden_size=64, num_attention_heads=8,
                         mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8, position_embedding_type="none",
                         normalization="RMSNorm").model
    assert recurrent_split(hybrid) == 2 and recurrent_split(MODEL) == 0
    shapes = list(parallel_shapes(hybrid, Cluster(16, 8, "h100"), 64, 64))
    assert shapes and all(2 % (s["tp"] * s["cp"]) == 0 for s in shapes)
    assert {(s["tp"], s["cp"]) for s in shapes} == {(1, 1), (2, 1), (1, 2)}
