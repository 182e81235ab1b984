"""Checks of --fine-grained-activation-offloading and its flags (paratron/model/activation_offload.py), after the
recompute flags are resolved (config/check_train.validate_recompute): Megatron's rules, and where paratron's
offloading does not reach."""
from __future__ import annotations

from .rules import listed, need
from .values import OFFLOAD_MISSING, OFFLOAD_MODULES

# what a selective recomputation already leaves unsaved: offloading those modules has nothing to move
RECOMPUTED = {"core_attn": ("core_attn",), "layernorm": ("attn_norm", "mlp_norm"), "moe_act": ("moe_act",),
              "moe": ("expert_fc1", "moe_act")}


def validate_activation_offload(cfg) -> None:
    tr = cfg.train
    given = tr.offload_modules is not None
    mods = listed(tr.offload_modules) if given else []
    if not tr.fine_grained_activation_offloading:
        need(not given, "--offload-modules has no effect without --fine-grained-activation-offloading; add it or "
             "remove the modules")
        return
    need(mods, "--fine-grained-activation-offloading needs --offload-modules (e.g. --offload-modules core_attn "
         "expert_fc1)")
    for name in mods:
        need(name not in OFFLOAD_MISSING, f"--offload-modules {name}: offloads {OFFLOAD_MISSING.get(name)}; remove it")
        need(name in OFFLOAD_MODULES, f"--offload-modules {name}: choose from {', '.join(OFFLOAD_MODULES)}")
    need("attn_proj" not in mods or "core_attn" in mods, "--offload-modules attn_proj needs core_attn too (as in "
         "Megatron: attn_proj's input is core_attn's output, which core_attn's backward keeps)")
    need(tr.delta_offload_bytes_across_pp_ranks == 0, "--delta-offload-bytes-across-pp-ranks is not implemented: "
         "every pipeline stage offloads the same modules; remove it")
    need(not tr.delay_offload_until_cuda_graph, "--delay-offload-until-cuda-graph: activation offloading does not run "
         "under --cuda-graph-impl local; remove it")
    need(tr.recompute_granularity != "full", "--fine-grained-activation-offloading with --recompute-granularity full: "
         "a recomputed layer keeps nothing to offload; use selective recomputation or no recomputation")
    need(not tr.torch_compile, "--fine-grained-activation-offloading is not supported with --torch-compile (its "
         "saved-tensor hooks run eagerly); remove one")
    need(cfg.model.model != "t5", "--fine-grained-activation-offloading is wired into the decoder of GPT, BERT and "
         "hybrid models, not T5's stacks; remove it")
    if tr.recompute_granularity == "selective":
        for recomputed, points in RECOMPUTED.items():
            both = [p for p in points if p in mods]
            need(recomputed not in tr.recompute_modules or not both,
                 f"--offload-modules {both[0] if both else ''} with --recompute-modules {recomputed}: recomputed "
                 "activations are not saved, so there is nothing to offload; remove one")
    tr.offload_modules = mods
