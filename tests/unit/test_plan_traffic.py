"""The plan's memory-bound time (paratron/plan/traffic.py) and its counted bytes (paratron/train/traffic.py)."""
import torch

from paratron.plan.cost import Cluster, step_time
from paratron.plan.layout import Layout, layout_of
from paratron.plan.paths import Paths
from paratron.plan.search import dp_bytes
from paratron.plan.traffic import HBM_GBPS, Traffic, optimizer_bytes, region_bytes, step_bytes
from paratron.train.traffic import SEQS, ByteCounter, count_bytes, counting, linear, short_copy, split, traffic_of
from tests.parallel.common import tiny_config


def test_counted_bytes_of_known_operations():
    x, w = torch.ones(8, 16, dtype=torch.bfloat16), torch.ones(16, 4, dtype=torch.bfloat16)
    with ByteCounter() as c:
        y = x.t().t() * 2  # views move nothing; the multiply reads x and writes y (256 bytes each)
        z = y + 1  # reads y, writes z
        z @ w  # a matmul: not counted, but its read of z ends the fused run (z written)
        z.exp()  # a new run: reads z again, writes its output (never read: not written in the fused count)
    assert c.eager == {("other", "F"): 256 * 6}
    # fused: run 1 reads x and writes z (y stays inside), run 2 reads z
    assert c.fused.bytes[("other", "F")] == 256 * 3
    assert c.compiled.bytes["F"] == 256 * 3


def test_half_precision_matmuls_run_in_fp32_and_count_the_same_bytes(monkeypatch):
    """The count runs bf16 matmuls in fp32 (compute): the product rounded to bf16, the bytes of every region as
    where the matmuls run in bf16 (a bf16 MoE model, grouped GEMMs and the loss head's matmuls)."""
    import paratron.train.traffic as tr
    a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    out = tr.compute(torch.ops.aten.mm.default, (a, b), {})
    assert out.dtype == torch.bfloat16 and torch.equal(out, (a.float() @ b.float()).bfloat16())
    cfg = tiny_config("llama", world_size=1, bf16=True, num_experts=4, moe_router_topk=2, moe_grouped_gemm=True)
    upcast = count_bytes(short_copy(cfg, 1, 32))
    monkeypatch.setattr(tr, "compute", lambda func, args, kwargs: func(*args, **kwargs))
    assert upcast == count_bytes(short_copy(cfg, 1, 32))


def test_a_decomposed_attention_core_is_not_counted():
    """With attention dropout torch's CPU attention runs its math path, aten operations on [s, s] scores that the
    GPU runs inside one attention kernel: ``counting`` leaves them out, forward and backward (what is left, the
    inputs' and the loss's operations, grows as the sequence, not as its square)."""
    import torch.nn.functional as F

    def counted(counter, s: int) -> int:
        x = torch.randn(3, 1, 4, s, 32, requires_grad=True, generator=torch.Generator().manual_seed(0))
        with counter() as c:
            q, k, v = (x * 2).unbind(0)
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum().backward()
        return sum(c.eager.values())
    assert counted(counting, 128) <= 2.05 * counted(counting, 64)
    assert counted(ByteCounter, 128) > 3 * counted(ByteCounter, 64)  # (the scores', uncounted above)


def test_optimizer_bytes_per_parameter():
    # bf16 weights, fp32 gradients: norm read 4; AdamW reads master 4, grad 4, moments 8, writes master 4,
    # moments 8, the bf16 weight 2; zeroing 4
    assert optimizer_bytes(2, 4) == 4 + (4 + 4 + 8) + (4 + 8 + 2) + 4
    assert optimizer_bytes(4, 4) == 4 + (4 + 4 + 8) + (4 + 8) + 4


def test_regions_take_the_planned_paths():
    rows = (("norm", "F", 10.0, 1.0, 4.0, 0.5), ("rope", "B", 0.0, 3.0, 0.0, 1.0), ("other", "B", 0.0, 2.0, 0.0, 1.0),
            ("loss", "F", 0.0, 8.0, 0.0, 2.0))
    # torch paths: norm, rope and other eager, the loss fused
    assert region_bytes(rows, Paths(), 100) == 10 + 100 + 300 + 200 + 200
    # quack's norm fused, the rotary inside FlashAttention-4: nothing
    assert region_bytes(rows, Paths(quack_norm=True, fused_rope=True), 100) == 4 + 50 + 200 + 200
    assert region_bytes(rows, Paths(), 100, forward_only=True) == 10 + 100 + 200
    # the fixed (weight-sized) bytes over TP, the experts' over EP x expert-TP
    experts = rows + (("other-experts", "B", 40.0, 1.0, 0.0, 0.0),)
    assert region_bytes(experts, Paths(), 100, split=(2, 8)) == 10 / 2 + 100 + 300 + 200 + 200 + 40 / 8 + 100


def test_step_bytes_scale_with_tokens_layers_and_micro_batches():
    t = Traffic(layer=(("other", "F", 0.0, 3.0, 0.0, 1.0), ("other", "B", 5.0, 7.0, 0.0, 1.0)),
                rest=(("other", "F", 11.0, 2.0, 0.0, 1.0),), compiled=(1.0, 2.0, 3.0, 4.0), compiled_forward=(0.5, 1.0))
    L = Layout(micro_batch=2, global_batch=8, seq_length=16, traffic=t)
    model = tiny_config("gpt", world_size=1).model  # 2 layers
    tokens, opt = 32, 1000 * optimizer_bytes(2, 4)
    eager = 4 * (2 * (5 + 10 * tokens) + 11 + 2 * tokens) + opt
    assert step_bytes(model, L, 1000) == eager
    full = 4 * (2 * (5 + 13 * tokens) + 11 + 2 * tokens) + opt  # the layers' forward again
    assert step_bytes(model, L.replace(recompute="full"), 1000) == full
    assert step_bytes(model, L.replace(compiled=True), 1000) == 4 * (2 * (1 + 2 * tokens) + 3 + 4 * tokens) + opt
    # ZeRO-1 over 2 ranks: each steps half the parameters; offload 1.0: none on the GPU
    assert step_bytes(model, L.replace(dp=2, global_batch=16, sharding="optim"), 1000) == eager - opt / 2
    assert step_bytes(model, L.replace(offload_fraction=1.0), 1000) == eager - opt
    assert step_bytes(model, L.replace(traffic=None), 1000) == 0.0


def test_fixed_bytes_split_over_tp_and_the_experts_over_ep():
    """A layer's fixed (weight-sized) bytes: the dense ones over TP, the experts' over EP x expert-TP; compiled (one
    figure, no regions) split in the eager count's proportion."""
    t = Traffic(layer=(("other", "B", 30.0, 0.0, 30.0, 0.0), ("other-experts", "B", 10.0, 0.0, 10.0, 0.0)),
                compiled=(40.0, 0.0, 0.0, 0.0))
    model = tiny_config("gpt", world_size=1).model  # 2 layers
    L = Layout(micro_batch=1, global_batch=1, seq_length=16, traffic=t, tp=2, ep=4)
    assert step_bytes(model, L, 0) == 2 * (30 / 2 + 10 / 4)
    assert abs(step_bytes(model, L.replace(compiled=True), 0) - 2 * (30 / 2 + 10 / 4)) < 1e-9
    assert step_bytes(model, L.replace(tp=1, ep=1), 0) == 2 * 40


def test_step_time_charges_the_bytes_at_the_memory_bandwidth():
    cfg = tiny_config("gpt", world_size=1, bf16=True)
    t = Traffic(layer=(("other", "F", 0.0, 1e6, 0.0, 0.0),))
    L, v = layout_of(cfg, "h200", traffic=t), cfg.padded_vocab_size
    grads, weights = dp_bytes(cfg.model, v, L, {})
    cluster = Cluster(1, 1, "h200", memory_efficiency=0.5)
    got = step_time(cfg.model, v, L, cluster, grads, weights).memory
    assert abs(got - step_bytes(cfg.model, L, grads // 4) / (HBM_GBPS["h200"] * 1e9 * 0.5)) < 1e-15
    assert got > 0 and step_time(cfg.model, v, L.replace(traffic=None), cluster, grads, weights).memory == 0.0


def test_counted_bytes_are_fixed_plus_per_token():
    """The fit through two sequence lengths predicts the count at a third."""
    cfg = tiny_config("llama", world_size=1, bf16=True)
    one, two = (count_bytes(short_copy(cfg, n, 48)) for n in (1, 2))
    layer, _ = split(one, two)
    fitted = linear([split(count_bytes(short_copy(cfg, 1, s)), count_bytes(short_copy(cfg, 2, s)))[0] for s in SEQS],
                    SEQS)
    for key, n in layer.items():
        assert abs(fitted[key][0] + fitted[key][1] * 48 - n) <= 0.02 * abs(n) + 64, key
    t = traffic_of(cfg)
    assert {r[0] for r in t.layer} >= {"norm", "rope", "swiglu"} and t.compiled[1] > 0


def test_narrowed_counts_scale_back_to_the_full_widths(monkeypatch):
    """A multi-latent-attention MoE counted at half its widths (latent ranks and head dimensions included) gives
    the full widths' per-token bytes once multiplied back, within 2 % at these toy widths (what is left is the
    router's bytes per expert, which no width scales: small at real widths); leaving the latent widths
    un-narrowed is off by more than 5 %."""
    import paratron.train.traffic as tr
    cfg = tiny_config("llama", world_size=1, bf16=True, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                      group_query_attention=False, multi_latent_attention=True, q_lora_rank=64, kv_lora_rank=64,
                      qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=128, vocab_size=1024)

    def per_token(narrow_to: int) -> float:
        monkeypatch.setattr(tr, "NARROW_TO", narrow_to)
        return sum(r[3] for r in tr.traffic_of(cfg).layer)
    full, halved = per_token(10 ** 9), per_token(128)
    assert tr.narrowing(cfg) == 2 and abs(halved - full) <= 0.02 * full, (halved, full)
    monkeypatch.setattr(tr, "widths_of", lambda c: tr.WIDTHS)
    assert abs(per_token(128) - full) > 0.05 * full


PROFILE = "benchmarks/results/profile_kernels_moe-mini_mb4_selective_eager_h200_20261203.tsv"


def profile_ms(pick) -> float:
    """ms per step of the profile record's kernels that ``pick(kind, name)`` selects."""
    import csv
    with open(PROFILE) as f:
        return sum(float(r["ms_per_step"]) for r in csv.DictReader(f, delimiter="\t") if pick(r["kind"], r["kernel"]))


def test_memory_bound_time_and_grouped_gemms_against_the_moe_profile():
    """moe-mini mb4 selective on one H200 (docs/plan.md): the plan's memory-bound time against the profiled
    kernels that are neither matmuls nor the attention core, and the experts' grouped GEMMs' fraction of the
    dense peak (Megatron's expert FLOPs over their kernels' time) against the assumed matmul efficiency."""
    from paratron.config import parse_args
    from paratron.plan.cost import GPUS, MATMUL_EFFICIENCY
    from paratron.train.traffic import traffic_for
    cfg = parse_args(["--config", "moe-mini", "--micro-batch-size", "4", "--global-batch-size", "4",
                      "--recompute-granularity", "selective"])
    L, v = layout_of(cfg, "h200", traffic=traffic_for(cfg, "h200")), cfg.padded_vocab_size
    planned = step_time(cfg.model, v, L, Cluster(1, 1, "h200"), *dp_bytes(cfg.model, v, L, {})).memory * 1e3
    measured = profile_ms(lambda kind, name: kind not in ("matmul", "attention"))
    assert abs(planned / measured - 1) < 0.10, (planned, measured)
    m = cfg.model
    expert_flops = 6 * m.hidden_size * m.moe_ffn_hidden_size * 3 * m.moe_router_topk * 4 * m.seq_length * m.num_layers
    grouped = profile_ms(lambda kind, name: "GroupProblem" in name and "prepare" not in name) * 1e-3
    assert expert_flops / grouped / (GPUS["h200"][1] * 1e12) > MATMUL_EFFICIENCY
