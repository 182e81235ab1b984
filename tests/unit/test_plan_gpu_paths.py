"""The planner's GPU-path terms against what the fused kernels' autograd functions save, run on the CPU through
their references (quack's RMSNorm and gated GEMMs), the paths a Hopper kind resolves to, and the host model's
operation count against a count of the aten operations of a tiny model's forward and backward."""
import torch

from paratron.kernels import quack_mlp, quack_norm
from paratron.plan.activations import mlp_bytes, norm_bytes
from paratron.plan.cost import Cluster, host_exposed
from paratron.plan.host import HOST_OP_US
from paratron.train.host_ops import OpCounter, count_ops, host_ops_for, ops_per_layer, tiny_copy
from paratron.plan.layout import layout_of
from paratron.plan.paths import Paths
from tests.parallel.common import tiny_config


def saved(fn, *args) -> int:
    """Bytes of the distinct storages ``fn`` saves for backward, the leaf inputs that require grad (weights)
    left out."""
    skip = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.requires_grad}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_hopper_kind_takes_the_fused_paths_and_cpu_the_torch_ones():
    cfg = tiny_config("llama", world_size=1, bf16=True)
    assert layout_of(cfg, "h200").paths.quack_norm and layout_of(cfg, "h200").paths.gated_gemm
    assert layout_of(cfg, "h200").paths.fused_rope
    assert not layout_of(cfg, "a100").paths.quack_norm and not layout_of(cfg, "a100").paths.gated_gemm
    assert layout_of(cfg).paths == Paths()
    asked_torch = tiny_config("llama", world_size=1, bf16=True, kernel_rmsnorm="torch", kernel_gated_mlp="torch")
    assert not layout_of(asked_torch, "h200").paths.quack_norm and not layout_of(asked_torch, "h200").paths.gated_gemm


def test_quack_norm_saves_what_the_plan_counts():
    cfg = tiny_config("llama", world_size=1, bf16=True)
    tokens, h = 48, cfg.model.hidden_size
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=False)
    w = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
    got = saved(lambda a, b: quack_norm.rms_norm_keep(a.clone(), b, 1e-5), x, w)
    assert got == tokens * norm_bytes(cfg.model, 2, Paths(quack_norm=True))
    assert got < tokens * norm_bytes(cfg.model, 2, Paths())  # the torch path keeps an fp32 copy besides


def test_gated_gemms_save_what_the_plan_counts():
    cfg = tiny_config("llama", world_size=1, bf16=True)
    tokens, h, f = 48, cfg.model.hidden_size, cfg.model.ffn_hidden_size
    x = torch.randn(tokens, h, dtype=torch.bfloat16)
    w1 = torch.randn(2 * f, h, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(h, f, dtype=torch.bfloat16, requires_grad=True)
    for keep in (True, False):
        got = saved(lambda a, b, c: quack_mlp.gated_mlp(a.clone(), b, c, keep_act=keep), x, w1, w2)
        fc1_input = tokens * h * 2  # counted with the layer's matmul inputs
        assert got == fc1_input + tokens * mlp_bytes(cfg.model, f, 2, Paths(gated_gemm=True, keep_act=keep))


def test_host_operation_count_is_the_dispatch_count():
    cfg = tiny_config("llama", world_size=1)
    layer, rest = ops_per_layer(cfg)
    for n in (1, 3):
        assert count_ops(tiny_copy(cfg, n)) == n * layer + rest
    assert ops_per_layer(tiny_config("llama", world_size=1, num_experts=4, moe_router_topk=2))[0] > layer
    with OpCounter() as c:
        torch.ones(3).add(1)
    assert c.count == 2


def test_host_time_exposed_only_beyond_the_gpu():
    cfg = tiny_config("llama", world_size=1, bf16=True)
    layout = layout_of(cfg, "h200", host_ops_for(cfg, "h200"))
    layer, rest = layout.host_ops
    assert layer > 0 and rest > 0
    issue = layout.microbatches * (layer * cfg.model.num_layers + rest) * HOST_OP_US["h200"] * 1e-6
    cluster = Cluster(1, 1, "h200")
    assert abs(host_exposed(cfg.model, layout, cluster, 0.0) - issue) < 1e-9
    assert host_exposed(cfg.model, layout, cluster, issue * 2) == 0.0
    assert host_ops_for(tiny_config("llama", world_size=1, torch_compile=True), "h200") == (0, 0)
    assert host_ops_for(tiny_config("llama", world_size=1, cuda_graph_impl="local",
                                    cuda_graph_scope=["full_iteration"]), "h200") == (0, 0)  # (one replay a step)
    assert host_ops_for(cfg, None) == (0, 0)


def test_a_runs_switches_resolved_on_a_gpu_are_planned_as_they_are_not_resolved_again_on_the_cpu():
    """The training run resolves its switches on its GPU (Triton kernels chosen), then prints the memory plan
    from that config: the planner must take them as they are (it re-resolved them on a CPU stand-in and
    refused the Triton choices there, which stopped every GPU run's start-up)."""
    from paratron.kernels import switches
    cfg = tiny_config("llama", world_size=1, bf16=True)
    gpu = switches.resolve(cfg.kernels, "cpu", torch.bfloat16, offered=switches.offer_of_kind(True))
    assert gpu.kernel_fp8_block_cast == "triton" and gpu.kernel_decode_coordinate_descent == "auto"
    assert switches.device_resolved(gpu) and not switches.device_resolved(cfg.kernels)
    run = cfg.with_section("kernels", gpu)
    assert layout_of(run).paths.quack_norm  # as resolved for the GPU, not the CPU's torch paths
    from paratron.plan.memory import startup_lines  # what the Trainer prints at start-up from that config
    assert startup_lines(run)[0].startswith(" memory plan (")


def test_a_blockwise_fp8_run_is_counted_on_copies_of_whole_128_wide_tiles(tmp_path):
    """The counted copies of a blockwise FP8 run (its recipe given, or named by --te-precision-config-file) keep
    their GEMM sizes and tokens multiples of 128, which the run's config check requires: `paratron plan` of such a
    run stopped at that check on its own tiny copy."""
    from paratron.config import parse_args
    from paratron.train.host_ops import tile_aligned
    from paratron.train.traffic import traffic_for
    base = ["--config", "tiny", "--mock-data", "--bf16", "--hidden-size", "128", "--ffn-hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--num-layers", "2"]
    cfg = parse_args(base + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"])
    assert tile_aligned(cfg)
    layer, rest = host_ops_for(cfg, "h100")
    assert layer > 0 and rest > 0 and traffic_for(cfg, "h100") is not None
    rules = tmp_path / "precision.yaml"
    rules.write_text('configs:\n  block:\n    transformer_engine_config_type: "TEQuantizationParams"\n'
                     '    training_recipe: {fp8_quantization_recipe: blockwise}\nmatchers:\n  mlp:\n    type: "glob"\n'
                     '    pattern: "*.mlp.*"\n    config: "block"\n    enabled: true\n')
    named = parse_args(base + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--te-precision-config-file",
                               str(rules)])
    assert tile_aligned(named) and host_ops_for(named, "h100")[0] > 0
    assert not tile_aligned(parse_args(base + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]))
    assert not tile_aligned(parse_args(base))


def test_fp8_paths_follow_each_modules_precision():
    """--te-precision-config-file's modules kept in bf16 plan no FP8 inputs; the others as the run's recipe."""
    fp8 = dict(fp8_format="e4m3", bf16=True, num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=64)
    every = layout_of(tiny_config("llama", world_size=1, **fp8))
    assert every.paths.fp8_qkv and every.paths.fp8_proj and every.paths.shared_mlp.fp8_inputs
    experts = layout_of(tiny_config("llama", world_size=1, **fp8,
                                    te_precision_config_file="configs/precision/moe_experts_fp8.yaml"))
    assert not (experts.paths.fp8_qkv or experts.paths.fp8_proj or experts.paths.shared_mlp.fp8_inputs)
    assert experts.fp8_rules and not every.fp8_rules


def test_fp8_share_of_the_matmuls_follows_each_modules_precision():
    """The routed experts alone in FP8: their FLOPs' share by hand (a token passes top-k of the E experts' weights),
    and the step planned slower than with every linear in FP8."""
    from paratron.plan.cost import Cluster, fp8_share, step_time
    moe = dict(fp8_format="e4m3", bf16=True, num_experts=4, moe_router_topk=2, global_batch_size=2)
    cfg = tiny_config("llama", world_size=1, **moe, te_precision_config_file="configs/precision/moe_experts_fp8.yaml")
    m = cfg.model
    q, kv, f = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups, m.moe_ffn_hidden_size
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    experts = m.moe_router_topk * (2 * f * m.hidden_size + m.hidden_size * f)  # SwiGLU's fc1 is 2f wide
    assert abs(fp8_share(m, layout_of(cfg)) - experts / (experts + attention)) < 1e-12
    every = tiny_config("llama", world_size=1, **moe)
    assert fp8_share(every.model, layout_of(every)) == 1.0
    cluster = Cluster(1, 8, "h100")
    times = [step_time(c.model, c.padded_vocab_size, layout_of(c, "h100"), cluster, 0, 0).compute for c in (cfg, every)]
    assert times[0] > times[1]


def test_first_last_layers_bf16_plan_their_matmuls_at_bf16():
    """--first-last-layers-bf16 with 1 + 1 of 4 layers: half the layers' matmul FLOPs in FP8, their layouts bf16."""
    from paratron.plan.cost import fp8_share
    cfg = tiny_config("llama", world_size=1, fp8_format="hybrid", bf16=True, num_layers=4, first_last_layers_bf16=True,
                      num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    layout = layout_of(cfg)
    assert layout.bf16_layers == {0, 3} and abs(fp8_share(cfg.model, layout) - 0.5) < 1e-12
    assert layout.at(1).paths.fp8_qkv and not layout.at(0).paths.fp8_qkv and not layout.at(3).paths.fp8_inputs


def test_first_last_layers_bf16_plans_from_the_command_line(capsys):
    """`paratron plan` counts the host's operations and the memory-bound bytes on one- and two-layer copies of the
    model: --first-last-layers-bf16's layer counts, valid for the model, are not asked of the copies."""
    from paratron.plan.cli import plan_main
    from paratron.train.traffic import traffic_for
    flags = ["--gpus", "1", "--gpu", "h100", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size",
             "2", "--vocab-size", "512", "--mock-data", "--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16",
             "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "1"]
    assert plan_main(flags, host_ops_for, traffic_for) == 0
    assert "as given:" in capsys.readouterr().out
