"""The planner's activation memory against the bytes autograd really saves for backward on CPU (saved-tensor
hooks, each storage counted once, parameters left out), one forward of one micro-batch through the model."""
import pytest
import torch

from paratron.plan.layout import layout_of
from paratron.plan.memory import rank_memory
from paratron.train.loop import build_dims, build_model_chunks
from tests.parallel.common import tiny_config


def saved_bytes(cfg) -> int:
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), t)  # (held, as kept_bytes does: a storage freed during
        return t  # the forward, e.g. one an offloading hook took, cannot hand its address to a later saved tensor)
    tokens = torch.randint(0, 500, (cfg.train.micro_batch_size, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens)
    return sum(t.untyped_storage().nbytes() for t in seen.values())


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
CASES = [("gpt", {}), ("llama", {}), ("llama", dict(recompute_granularity="selective")), ("llama", FULL),
         ("llama", dict(num_layers=4, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
         ("gpt", dict(seq_length=64, micro_batch_size=4)), ("gpt", dict(bf16=True)),
         ("llama", dict(num_experts=4, moe_router_topk=2)),
         ("llama", dict(num_layers=3, num_experts=8, moe_router_topk=2, moe_shared_expert_intermediate_size=64,
                        moe_layer_freq="[0,1,1]")),
         ("llama", dict(mtp_num_layers=2)), ("gpt", dict(mtp_num_layers=1)), ("llama", dict(mtp_num_layers=1, bf16=True)),
         ("llama", dict(mtp_num_layers=1, num_experts=4, moe_router_topk=2)),
         ("llama", dict(num_experts=4, moe_router_topk=2, moe_latent_size=16)),
         ("gpt", dict(num_experts=4, moe_router_topk=2, moe_latent_size=32, bf16=True))]
# FP8 (emulated on the CPU, the FP8 copies one byte an element as on a GPU): each forward keeps the FP8 copies of the
# layers' weights for its backward (one micro-batch a step: the step's weight cache is not used)
CASES += [("llama", dict(fp8_format="hybrid", bf16=True, global_batch_size=2)),
          ("gpt", dict(fp8_format="e4m3", fp8_recipe="tensorwise", bf16=True, global_batch_size=2))]
# --te-precision-config-file keeping attention, the dense MLP and the shared expert in bf16 (the routed experts alone in
# FP8; without experts every linear in bf16): their inputs saved in bf16, no FP8 copies of their weights
EXPERTS_FP8 = dict(fp8_format="e4m3", bf16=True, global_batch_size=2,
                   te_precision_config_file="configs/precision/moe_experts_fp8.yaml")
CASES += [("llama", dict(num_experts=4, moe_router_topk=2, **EXPERTS_FP8)), ("llama", EXPERTS_FP8)]
# --first-last-layers-bf16: the first and last layers' inputs in bf16, no FP8 copies of their weights
EDGES = dict(bf16=True, global_batch_size=2, num_layers=4, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
             num_layers_at_end_in_bf16=1)
CASES += [("llama", dict(fp8_format="hybrid", **EDGES)),
          ("llama", dict(fp8_format="e4m3", num_experts=4, moe_router_topk=2, **EDGES))]
# the routed experts in FP8: the fused experts MLP (its rows padded per expert), the per-layer path, a shared expert
CASES += [("llama", dict(num_experts=4, moe_router_topk=2, kernel_fp8_fused_mlp="off", **EXPERTS_FP8)),
          ("llama", dict(fp8_format="e4m3", bf16=True, global_batch_size=4, seq_length=64, micro_batch_size=4,
                         num_experts=4, moe_router_topk=2)),
          ("llama", dict(fp8_format="e4m3", bf16=True, global_batch_size=2, num_layers=3, num_experts=8,
                         moe_router_topk=2, moe_shared_expert_intermediate_size=64, moe_layer_freq="[0,1,1]")),
          ("llama", dict(fp8_format="e4m3", fp8_recipe="blockwise", bf16=True, global_batch_size=2, seq_length=128,
                         max_position_embeddings=128, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                         num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256))]
# the blockwise recipe's dense layers: each FP8 copy with a float32 scale per 1 x 128 tile, the fused block MLP
# (fp8/block_mlp.py: fc1's output in bf16, the SwiGLU's FP8 tiles) and the per-layer path
BLOCK = dict(fp8_format="e4m3", fp8_recipe="blockwise", bf16=True, global_batch_size=2, seq_length=128,
             max_position_embeddings=128, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4)
CASES += [("llama", BLOCK), ("llama", dict(kernel_fp8_fused_mlp="off", **BLOCK))]


# hybrid stacks on the torch scans with recomputation (docs/plan.md): each layer kind alone and mixed, fp32 and bf16
HYBRID = dict(normalization="RMSNorm", position_embedding_type="none", disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=4,
              mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
CASES += [("gpt", dict(hybrid_layer_pattern="M", **HYBRID)), ("gpt", dict(hybrid_layer_pattern="G", **HYBRID)),
          ("gpt", dict(hybrid_layer_pattern="M*G-", squared_relu=True, **HYBRID)),
          ("gpt", dict(hybrid_layer_pattern="MG*E", num_experts=4, moe_router_topk=2, bf16=True, **HYBRID)),
          ("llama", dict(experimental_attention_variant="gated_delta_net", linear_attention_freq="2", num_layers=2,
                         **{**HYBRID, "position_embedding_type": "rope"}))]
# --kernel-linear-scan-recompute off: the scans' intra-chunk products kept (four chunks of 8 per sequence)
OFF = dict(kernel_linear_scan_recompute="off", mamba_chunk_size=8, **HYBRID)
CASES += [("gpt", dict(hybrid_layer_pattern="M", **OFF)),
          ("gpt", dict(hybrid_layer_pattern="G", micro_batch_size=1, **OFF)),
          ("gpt", dict(hybrid_layer_pattern="M*G-", squared_relu=True, micro_batch_size=4, **OFF)),
          ("gpt", dict(hybrid_layer_pattern="MG*E", num_experts=4, moe_router_topk=2, bf16=True, **OFF))]


@pytest.mark.parametrize("style,extra", CASES, ids=[f"{s}-{'-'.join(e) or 'plain'}" for s, e in CASES])
def test_activation_bytes_match_saved_tensors(style, extra):
    cfg = tiny_config(style, world_size=1, **extra)
    predicted = rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).activations
    measured = saved_bytes(cfg)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


# --fine-grained-activation-offloading (model/activation_offload.py): what the offloaded points take off the device
ALL_POINTS = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
MOE = dict(num_experts=4, moe_router_topk=2)
OFFLOAD_CASES = [
    ("llama", {}, dict(offload_modules=ALL_POINTS[:5])),
    ("gpt", {}, dict(offload_modules=["core_attn", "mlp_norm"])),
    ("gpt", {}, dict(offload_modules=["qkv_linear", "core_attn", "attn_proj"], min_offloaded_tensor_size=100)),
    ("llama", dict(bf16=True, **MOE), dict(offload_modules=ALL_POINTS)),
    ("gpt", MOE, dict(offload_modules=ALL_POINTS)),
    ("llama", MOE, dict(offload_modules=["qkv_linear", "expert_fc1", "moe_act"], activation_offload_fraction=0.5)),
    ("llama", dict(moe_latent_size=16, **MOE), dict(offload_modules=["expert_fc1", "moe_act", "attn_norm"])),
    ("gpt", dict(hybrid_layer_pattern="M*E", bf16=True, **MOE, **HYBRID),
     dict(offload_modules=["attn_norm", "mlp_norm", "core_attn", "expert_fc1"])),
]


@pytest.mark.parametrize("style,extra,offload", OFFLOAD_CASES,
                         ids=[f"{s}{i}-{'-'.join(o['offload_modules'])}" for i, (s, _, o) in enumerate(OFFLOAD_CASES)])
def test_offloaded_activation_bytes_match(style, extra, offload):
    """The planner's saving against what autograd no longer keeps on the device (the saved-tensor hooks of the
    offloaded points take those tensors; min size 0 unless the case sets one: 100 elements leaves the
    per-token statistics of 64 tokens behind and takes the rest)."""
    base = tiny_config(style, world_size=1, **extra)
    off = tiny_config(style, world_size=1, **extra, **{"fine_grained_activation_offloading": True,
                                                       "min_offloaded_tensor_size": 0, **offload})

    def planned(cfg):
        return rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).activations
    predicted, measured = planned(base) - planned(off), saved_bytes(base) - saved_bytes(off)
    assert measured > 0 and abs(predicted / measured - 1) < 0.01, (predicted, measured)


def kept_bytes(cfg) -> int:
    """What autograd keeps for backward through nested saved-tensor hooks: the tensors an output-discarding
    recomputation's hooks let pass (they shadow the outer hooks) are counted, and so are the inputs a checkpoint
    holds (its own hooks drop everything else it saves)."""
    from paratron.model import moe as moe_module, recompute, transformer
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    params, held = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def count(t):
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in params:
            held.setdefault(t.untyped_storage().data_ptr(), t)  # (held: freed memory is not reused meanwhile)
        return t
    discard_pack, checkpoint = recompute._Discard.pack, transformer.checkpoint

    def pack(self, t):
        out = discard_pack(self, t)
        return count(t) if out is t else out

    def held_inputs(fn, *args, rng=None):
        for a in args:
            count(a)
        return checkpoint(fn, *args, rng=rng)
    tokens = torch.randint(0, 500, (cfg.train.micro_batch_size, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute._Discard, "pack", pack)
        mp.setattr(transformer, "checkpoint", held_inputs)
        mp.setattr(moe_module, "checkpoint", held_inputs)
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            model(tokens, labels=tokens)
    return sum(t.untyped_storage().nbytes() for t in held.values())


RECOMPUTE_MOE = dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=64)
RECOMPUTE_CASES = [("llama", {}, ["layernorm"]), ("llama", {}, ["mlp"]), ("gpt", {}, ["mlp", "core_attn"]),
                   ("llama", dict(bf16=True), ["mlp"]), ("llama", dict(bf16=True), ["layernorm", "core_attn"]),
                   ("gpt", {}, ["layernorm"]), ("llama", RECOMPUTE_MOE, ["moe"]),
                   ("llama", RECOMPUTE_MOE, ["shared_experts"]), ("llama", RECOMPUTE_MOE, ["layernorm", "moe"])]


@pytest.mark.parametrize("style,extra,modules", RECOMPUTE_CASES,
                         ids=[f"{s}{i}-{'-'.join(m)}" for i, (s, _, m) in enumerate(RECOMPUTE_CASES)])
def test_selective_recompute_modules_bytes_match(style, extra, modules):
    """--recompute-modules beyond core_attn (layernorm, mlp, moe, shared_experts) in the planner against what
    autograd keeps (kept_bytes: through the recomputations' own hooks)."""
    cfg = tiny_config(style, world_size=1, recompute_granularity="selective", recompute_modules=modules, **extra)
    predicted = rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).activations
    measured = kept_bytes(cfg)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_moe_act_recompute_saving_matches(style):
    """--recompute-modules moe_act: the activation's output per routed copy (gated or not), as a saving (the grouped
    GEMM's padded rows, which the planner does not count, are in both runs)."""
    extra = dict(moe_grouped_gemm=True, **RECOMPUTE_MOE)
    base = tiny_config(style, world_size=1, **extra)
    rec = tiny_config(style, world_size=1, recompute_granularity="selective", recompute_modules=["moe_act"], **extra)

    def planned(cfg):
        return rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).activations
    # (selective recomputation without core_attn: the base keeps the core's output as the rec run does)
    predicted, measured = planned(base) - planned(rec), kept_bytes(base) - kept_bytes(rec)
    assert measured > 0 and abs(predicted / measured - 1) < 0.02, (predicted, measured)
