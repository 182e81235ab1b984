"""Checks of hybrid stacks (Mamba-2 and Gated DeltaNet layers beside attention, docs/hybrid.md): the layer pattern
(``--hybrid-layer-pattern`` or its deprecated ``--hybrid-override-pattern``, or the older ratio flags), the
mixers' shapes, ``--experimental-attention-variant gated_delta_net`` with ``--linear-attention-freq``, the
``--spec`` names paratron accepts, and the parallel sizes these layers can be split over."""
from __future__ import annotations

from .layer_patterns import linear_attention_layers
from .rules import need
from .sections import ModelConfig, ParallelConfig

SYMBOLS = {"M": "Mamba-2", "G": "Gated DeltaNet", "*": "attention", "-": "MLP", "E": "MoE"}
REFUSED_SYMBOLS = {"D": "DeepSeek sparse attention", "+": "multi-latent attention"}
GDN_NAMES = ("gated_delta_net", "gdn")
# Megatron's stack specs (module function) that name what paratron builds from the flags: GPT and hybrid/Mamba.
SPECS = {("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
         ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),
         ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"),
         ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"), ("local",)}


def pattern_from_ratios(num_layers: int, attention: float, mlp: float) -> str:
    """Older Megatron's --hybrid-attention-ratio / --hybrid-mlp-ratio as a pattern: round(n x ratio) attention
    layers spread evenly between Mamba runs (the stack neither starts nor ends with one), then round(n x ratio)
    MLP layers spread evenly over the remaining Mamba layers (Megatron's allocation)."""
    kinds = ["M"] * num_layers
    n_attn = round(num_layers * attention)
    run = (num_layers - n_attn) / (n_attn + 1)  # Mamba layers between two attention layers
    budget = run
    for i in range(num_layers):
        if budget < 0.5:
            kinds[i], budget = "*", budget + run
        else:
            budget -= 1
    n_mlp = round(num_layers * mlp)
    if n_mlp:
        every = (num_layers - n_attn - n_mlp) / n_mlp
        budget = every
        for i in range(num_layers):
            if kinds[i] == "M":
                if budget < 0.5:
                    kinds[i], budget = "-", budget + every
                else:
                    budget -= 1
    return "".join(kinds)


def validate_hybrid(m: ModelConfig) -> None:
    """The layer pattern (sets --num-layers and --is-hybrid-model), the mixers' shapes and --spec."""
    need(m.hybrid_override_pattern is None or m.hybrid_layer_pattern is None, "--hybrid-override-pattern and "
         "--hybrid-layer-pattern exclude each other (the first is the deprecated name of the second); keep one")
    if m.hybrid_override_pattern is not None:
        m.hybrid_layer_pattern, m.hybrid_override_pattern = m.hybrid_override_pattern, None
    ratios = m.hybrid_attention_ratio or m.hybrid_mlp_ratio
    need(not ratios or m.hybrid_layer_pattern is None, "--hybrid-attention-ratio / --hybrid-mlp-ratio and "
         "--hybrid-layer-pattern exclude each other; give the pattern")
    need(0 <= m.hybrid_attention_ratio and 0 <= m.hybrid_mlp_ratio and m.hybrid_attention_ratio + m.hybrid_mlp_ratio
         <= 1, "--hybrid-attention-ratio and --hybrid-mlp-ratio are shares of the layers: each >= 0, their sum <= 1")
    if m.hybrid_layer_pattern is None and (ratios or m.is_hybrid_model):  # (no ratio: every layer Mamba-2)
        m.hybrid_layer_pattern = pattern_from_ratios(m.num_layers, m.hybrid_attention_ratio, m.hybrid_mlp_ratio)
        m.hybrid_attention_ratio = m.hybrid_mlp_ratio = 0.0
    pattern = m.hybrid_layer_pattern
    if pattern is not None:
        _check_pattern(pattern)
        m.num_layers, m.is_hybrid_model = len(pattern.replace("|", "")), True
    variant = m.experimental_attention_variant
    need(variant in (None,) + GDN_NAMES, f"--experimental-attention-variant {variant}: paratron has gated_delta_net "
         "(gdn); gdn2 and dsa are not implemented, remove the flag")
    need(variant is None or m.linear_attention_freq is not None or pattern is not None,
         "--experimental-attention-variant gated_delta_net needs --linear-attention-freq (every Nth layer attention)")
    need(m.linear_attention_freq is None or variant is not None, "--linear-attention-freq needs "
         "--experimental-attention-variant gated_delta_net")
    if m.linear_attention_freq is not None:
        linear_attention_layers(m.linear_attention_freq, m.num_layers)
    need(pattern is None or variant is None, "--experimental-attention-variant with --hybrid-layer-pattern: place "
         "Gated DeltaNet layers with G in the pattern instead")
    need(pattern is None or not m.mtp_num_layers, "--mtp-num-layers with --hybrid-layer-pattern: multi-token "
         "prediction for hybrid stacks is not implemented; remove --mtp-num-layers")
    _check_shapes(m)
    _check_spec(m.spec)


def _check_pattern(pattern: str) -> None:
    flag = "--hybrid-layer-pattern"
    need("/" not in pattern, f"{flag} {pattern}: multi-token prediction layers after '/' are not implemented for "
         "hybrid stacks; remove the '/...' part")
    for s in dict.fromkeys(pattern.replace("|", "")):
        need(s not in REFUSED_SYMBOLS, f"{flag} {pattern}: {s} ({REFUSED_SYMBOLS.get(s)}) layers are not "
             "implemented in hybrid stacks; use * (attention)")
        need(s in SYMBOLS, f"{flag} {pattern}: {s!r} is not a layer symbol (M Mamba-2, G Gated DeltaNet, "
             "* attention, - MLP, E MoE, | a pipeline stage boundary)")
    need(all(pattern.split("|")), f"{flag} {pattern}: every pipeline segment between '|' needs a layer")


def mamba_heads(m: ModelConfig) -> int:
    """Mamba-2 heads: --mamba-num-heads, else 2 x hidden / --mamba-head-dim (Megatron's expand 2)."""
    return m.mamba_num_heads if m.mamba_num_heads is not None else 2 * m.hidden_size // m.mamba_head_dim


def is_hybrid_stack(m: ModelConfig) -> bool:
    """Whether the stack is laid out by a hybrid pattern or mixes Gated DeltaNet layers in (counted layer by layer,
    not by the transformer's formula)."""
    return m.hybrid_layer_pattern is not None or m.experimental_attention_variant is not None


def gdn_chunk_size(m: ModelConfig) -> int:
    """The gated delta rule's scan chunk: --mamba-chunk-size, at most 64."""
    return min(m.mamba_chunk_size, 64)


def uses(m: ModelConfig, symbol: str) -> bool:
    """Whether the model has a layer of this hybrid symbol (G also through --experimental-attention-variant)."""
    if symbol == "G" and m.experimental_attention_variant is not None:
        return True
    return m.hybrid_layer_pattern is not None and symbol in m.hybrid_layer_pattern


def _check_shapes(m: ModelConfig) -> None:
    if uses(m, "M"):
        need(m.mamba_num_heads is not None or (2 * m.hidden_size) % m.mamba_head_dim == 0,
             f"2 x --hidden-size {m.hidden_size} is not divisible by --mamba-head-dim {m.mamba_head_dim}; "
             "change one or set --mamba-num-heads")
        heads = mamba_heads(m)
        need(heads % m.mamba_num_groups == 0, f"Mamba-2 heads {heads} are not divisible by --mamba-num-groups "
             f"{m.mamba_num_groups}; change --mamba-num-groups")
    if uses(m, "G"):
        need(m.linear_num_value_heads % m.linear_num_key_heads == 0, f"--linear-num-value-heads "
             f"{m.linear_num_value_heads} is not a multiple of --linear-num-key-heads {m.linear_num_key_heads}")
    need(m.mamba_chunk_size >= 1, f"--mamba-chunk-size {m.mamba_chunk_size} must be >= 1")


def _check_spec(spec) -> None:
    if spec is None:
        return
    need(tuple(spec) in SPECS, f"--spec {' '.join(spec)}: paratron builds its stack from the flags and accepts "
         "Megatron's GPT and hybrid stack specs only (megatron.core.models.hybrid.hybrid_layer_specs "
         "hybrid_stack_spec, megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec, "
         "megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_with_transformer_engine_spec / "
         "get_gpt_layer_local_spec, local)")


def validate_hybrid_parallel(par: ParallelConfig, m: ModelConfig) -> None:
    """Mamba-2 and Gated DeltaNet layers split whole heads / groups over TP x CP (context parallelism hands each CP
    rank the whole sequence of its share of a TP rank's heads)."""
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    ranks = f"--tensor-model-parallel-size {tp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "")
    if uses(m, "M"):
        need(mamba_heads(m) % (tp * cp) == 0 and m.mamba_num_groups % (tp * cp) == 0, f"Mamba-2 heads "
             f"{mamba_heads(m)} and --mamba-num-groups {m.mamba_num_groups} must both be divisible by {ranks}; "
             "change --mamba-num-groups / --mamba-num-heads or the parallel sizes")
    if uses(m, "G"):
        need(m.linear_num_key_heads % (tp * cp) == 0, f"--linear-num-key-heads {m.linear_num_key_heads} is not "
             f"divisible by {ranks}; change it or the parallel sizes")
    if m.hybrid_layer_pattern is not None and "|" in m.hybrid_layer_pattern:
        _pattern_stages(par, m.hybrid_layer_pattern)


def _pattern_stages(par: ParallelConfig, pattern: str) -> None:
    """'|' in the pattern: the pipeline stages, as a --pipeline-model-parallel-layout of decoder layers."""
    segments = pattern.split("|")
    need(par.pipeline_model_parallel_layout is None and par.decoder_first_pipeline_num_layers is None
         and par.decoder_last_pipeline_num_layers is None, "--hybrid-layer-pattern with '|' sets the pipeline "
         "stages; remove --pipeline-model-parallel-layout / --decoder-first/last-pipeline-num-layers")
    need(len(segments) == par.pipeline_model_parallel_size, f"--hybrid-layer-pattern {pattern} has {len(segments)} "
         f"pipeline segments; --pipeline-model-parallel-size is {par.pipeline_model_parallel_size} (virtual stages "
         "from the pattern are not implemented)")
    par.pipeline_model_parallel_layout = "E" + "|".join("t" * len(s) for s in segments) + "L"
