"""Activation memory: the bytes autograd keeps for the backward pass, per layer and micro-batch, in the
accounting of Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models"),
term by term for paratron's layers (what each of them saves, counted on CPU by
tests/unit/test_plan_activations.py with saved-tensor hooks):

* per norm: its input (RMSNorm: in fp32, and its normalised input; on quack's kernel its input as it is),
  its fp32 statistics;
* the inputs of the QKV and fc1 (or router) matmuls;
* attention: the fused QKV output, the rotated queries and keys (rope), the attention output and the fp32
  log-sum-exp per head (flash / memory-efficient attention keep no s x s scores: Korthikanti's 5as/h term
  is gone); selective recomputation (core_attn) keeps the output projection's input instead; context
  parallelism's ring adds its contiguous K/V and merged log-sum-exp;
* the MLP: fc1's output and the activation's output (gated: fc1 output 2f, activation f, fc2 input f; quack's
  gated GEMMs: the pre-activation 2f and the activation f, which is fc2's input);
* FP8: each linear keeps the FP8 copy of its input (1 byte; blockwise: and a float32 scale per 1 x 128 tile), not
  the input; the fused FP8 MLP keeps fc1's output in bf16 and the activation in FP8;
* MoE: the router's fp32 logits and routing indices, and per routed token (top-k) the permuted input,
  the expert MLP's tensors and the unpermute's (with expert parallelism: the all-to-all's buffers too;
  the share of routed tokens a rank gets is taken as even);
* dropout masks (1 byte, CUDA's dropout; torch's CPU dropout keeps a mask in the activation dtype) when
  --hidden-dropout > 0: after the embedding, attention and the MLP.

Tensor parallelism divides the attention and MLP terms; sequence parallelism also the norms' terms. The
column-parallel matmuls keep their whole input: under sequence parallelism paratron saves the all-gathered
input for the weight gradient (Megatron saves the shard and gathers it again in backward). Which kernels the
layers run (``layout.paths``, paths.py: the switches resolved for the planned GPU kind) decides the norm's, the
MLP's and the rotary embedding's terms: on Hopper quack's RMSNorm and gated GEMMs and FlashAttention-4's op with
the rotary embedding inside, whose rotated q and k selective recomputation recomputes rather than keeps. Full recomputation keeps a recomputed layer's input alone. A pipeline stage holds
the micro-batches in flight of its schedule (1F1B: PP - rank; interleaved: Megatron's warm-up count)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..config.check_hybrid import gdn_chunk_size, mamba_heads
from .layout import Layout
from .paths import Paths
from .shapes import CONV_WIDTH, layer_kinds

FP32, INDEX = 4, 8


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one layer saves for one micro-batch on one rank: replicated over TP without sequence parallelism
    (``sp``), split over TP (``tp``); ``input``: what full recomputation keeps."""
    full: int
    input: int


def dims_of(model: ModelConfig) -> tuple[int, int, int]:
    """(query width, key width, heads) of one layer's attention."""
    heads = model.num_attention_heads
    if model.multi_latent_attention:  # queries and keys of qk + rope dims per head (values taken as keys)
        d = model.qk_head_dim + model.qk_pos_emb_head_dim
        return heads * d, heads * d, heads
    return heads * model.kv_channels, model.num_query_groups * model.kv_channels, heads


def norm_bytes(model: ModelConfig, a: int, paths: Paths = Paths()) -> int:
    """Per token: what one norm saves. LayerNorm: its input and fp32 statistics; RMSNorm (computed in fp32,
    model/norms.py): the fp32 input, the statistic, and the normalised input cast back for the weight; on quack's
    kernel (kernels/quack_norm.py ``_NormKeep``): its input in the model's dtype and the statistic."""
    return sum(b for b, _ in norm_parts(model, a, paths))


def attention_parts(model: ModelConfig, layout: Layout, a: int) -> dict[str, list[tuple[int, int]]]:
    """Per token, before the TP split: what the attention saves, by what saves it, as (bytes, elements) per tensor:
    ``qkv`` the fused QKV output, ``core`` the core's own (rotated q and k, the output under FP8, the
    log-sum-exp, context parallelism's ring buffers), ``proj`` the output projection's input (without FP8 the
    core's output: one tensor that both keep)."""
    q, kv, heads, p = *dims_of(model), layout.paths
    selective = layout.recomputes("core_attn")
    gate = 2 if model.attention_output_gate else 1
    core = [] if selective else [(heads * FP32, heads)]
    proj = [(fp8_copy(q, p), q)] if p.fp8_proj else [(q * a, q)]  # FP8: the projection's own copy
    if p.fp8_proj and not selective:
        core.append((q * a, q))
    rotated_kept = not (selective and p.fused_rope)  # the fused op's rotated q, k recomputed with the core
    rotated = model.position_embedding_type in ("rope", "yarn") or model.multi_latent_attention
    if rotated and rotated_kept:
        core += [(q * a, q), (kv * a, kv)]
    elif not rotated and model.num_query_groups < heads:
        core.append((q * a, q))  # unrotated grouped queries: a copy (self_attention.py cuts them out of each group)
    if layout.cp > 1:  # the ring keeps its own contiguous K/V of the local chunk and the merged log-sum-exp
        core += [(kv * a, kv), (kv * a, kv), (heads * FP32, heads)]
    return {"qkv": [((q * gate + 2 * kv) * a, q * gate + 2 * kv)], "core": core, "proj": proj}


def attention_bytes(model: ModelConfig, layout: Layout, a: int) -> int:
    """Per token, before the TP split: QKV output, rotated q and k, the output, the log-sum-exp."""
    return sum(b for part in attention_parts(model, layout, a).values() for b, _ in part)


def norm_parts(model: ModelConfig, a: int, paths: Paths = Paths()) -> list[tuple[int, int]]:
    """What one norm saves (norm_bytes), (bytes, elements) per token and tensor."""
    h = model.hidden_size
    if model.normalization == "LayerNorm":
        return [(h * a, h), (FP32, 1), (FP32, 1)]
    return [(h * a, h), (FP32, 1)] if paths.quack_norm else [(h * FP32, h), (h * a, h), (FP32, 1)]


def offloaded_bytes(model: ModelConfig, layout: Layout, kind: tuple, points: frozenset, tokens: int) -> int:
    """Bytes of one micro-batch through one layer of ``kind`` that its offloaded ``points``
    (model/activation_offload.py) take off the device: each point's saved tensors of at least
    --min-offloaded-tensor-size elements, and the QKV output the attention core alone saves (its storage goes when
    the core's views of it go, unless the output gate keeps one). A tensor both the core and the projection save
    (the core's output, without FP8) goes with both."""
    if not points:
        return 0
    a, t, sp = layout.param_bytes, layout.tp, layout.sequence_parallel
    mixer, ffn = kind
    terms = []  # (bytes, elements) per token on this rank
    for name in ("attn_norm", "mlp_norm"):
        if name in points:
            terms += [(b // t, e // t) if sp else (b, e) for b, e in norm_parts(model, a, layout.paths)]
    if "qkv_linear" in points:  # (gathered under SP)
        h = model.hidden_size
        terms.append((fp8_copy(h, layout.paths) if layout.paths.fp8_qkv else h * a, h))
    if "core_attn" in points:
        parts = attention_parts(model, layout, a)
        kept = parts["core"] + ([] if model.attention_output_gate else parts["qkv"])
        kept += parts["proj"] if "attn_proj" in points else []
        terms += [(b // t, e // t) for b, e in kept]
    if ffn == "moe" and {"expert_fc1", "moe_act"} & points:
        h, k = model.moe_latent_size or model.hidden_size, model.moe_router_topk
        # the activation keeps its input, fc1's output (gated: 2f), and, gated, the gate's activated half (f)
        f = model.moe_ffn_hidden_size // layout.etp * (3 if model.swiglu or model.quick_geglu else 1)
        split = t if sp else 1
        terms += [(k * h * a // split, k * h // split)] if "expert_fc1" in points else []
        terms += [(k * f * a // split, k * f // split)] if "moe_act" in points else []
    return tokens * sum(b for b, e in terms if tokens * e >= layout.min_offloaded_tensor_size)


def offload_points(model: ModelConfig, layout: Layout, layers: list) -> list[frozenset]:
    """The offloaded points of each of a chunk's layers (``layers``: their kinds): --offload-modules' points each
    layer has (model/activation_offload.points_of), the first --activation-offload-fraction of them in forward order."""
    chosen, mods = [], layout.offload_modules
    for i, (mixer, ffn) in enumerate(layers):
        attention = mixer == "attention" and not model.multi_latent_attention
        have = (["attn_norm"] if mixer is not None else []) + \
            (["qkv_linear", "core_attn", "attn_proj"] if attention else []) + \
            (["mlp_norm"] if ffn is not None else []) + (["expert_fc1", "moe_act"] if ffn == "moe" else [])
        chosen += [(i, name) for name in have if name in mods]
    chosen = chosen[:round(layout.activation_offload_fraction * len(chosen))]
    return [frozenset(name for j, name in chosen if j == i) for i in range(len(layers))]


def fp8_copy(n: int, paths: Paths) -> int:
    """Bytes of an FP8 copy of ``n`` elements: one each, and under the blockwise recipe a float32 scale per 1 x 128
    tile besides (fp8/blockwise.py)."""
    return n + (n * FP32 // 128 if paths.fp8_tiles else 0)


def mlp_bytes(model: ModelConfig, ffn: int, a: int, paths: Paths = Paths()) -> int:
    """Per token, before the TP split (fc1's input is counted with the layer's inputs)."""
    gated = model.swiglu or model.quick_geglu
    if paths.gated_gemm and gated:  # kernels/quack_mlp.py _GatedMLP: the pre-activation (and the activation)
        return (3 if paths.keep_act else 2) * ffn * a
    if paths.fp8_mlp:  # fp8/mlp.py _FP8MLP: fc1's output in bf16, the activation's FP8 copy
        return (2 if gated else 1) * ffn * a + fp8_copy(ffn, paths)
    if paths.fp8_inputs:  # per layer: the activation's input (and gated, silu's output), fc2's FP8 input copy
        return (3 if gated else 1) * ffn * a + fp8_copy(ffn, paths)
    return (4 if gated else 2) * ffn * a


def moe_bytes(model: ModelConfig, layout: Layout, a: int) -> int:
    """Per token of the layer's input on this rank: router logits and indices, then top-k routed copies (under
    sequence parallelism each TP rank routes its own tokens; --moe-latent-size: in the latent width, with the
    combined latent output kept for its projection back), and the shared expert (a TP-split MLP)."""
    h, k, f = model.moe_latent_size or model.hidden_size, model.moe_router_topk, model.moe_ffn_hidden_size // layout.etp
    router = model.num_experts * FP32 + k * (2 * FP32 + 3 * INDEX)
    routed = routed_bytes(model, layout, a, h, f)
    latent = h * a if model.moe_latent_size else 0  # the combined latent output, the latent -> hidden input
    per_rank = (router + routed + latent) // (layout.tp if layout.sequence_parallel else 1)
    shared = model.moe_shared_expert_intermediate_size
    return per_rank + (mlp_bytes(model, shared, a, layout.paths.shared_mlp) // layout.tp if shared else 0)


def routed_bytes(model: ModelConfig, layout: Layout, a: int, h: int, f: int) -> int:
    """Per token of the layer's input on this rank, before the SP split: what the top-k routed copies save. bf16:
    each copy's input, the activation's terms and the combine's two (EP: the all-to-all buffers, two more). FP8
    (``Paths.experts_fp8``): the experts' rows padded, each expert's to a multiple of ``Paths.expert_align`` (at most
    one block more an expert); the fused MLP keeps the input and the activation transposed in FP8 and fc1's output in
    bf16; the per-layer path keeps bf16's terms and the inputs' transposed FP8 copies besides."""
    k, gated, p = model.moe_router_topk, model.swiglu or model.quick_geglu, layout.paths
    combine = k * (2 if layout.ep == 1 else 4) * h * a
    act = (4 if gated else 2) * f * a
    if not layout.paths.experts_fp8:
        return combine + k * (h * a + act)
    tokens = layout.micro_batch * layout.seq_length // layout.cp // (layout.tp if layout.sequence_parallel else 1)
    rows = k + model.num_experts // layout.ep * layout.paths.expert_align / max(1, tokens)  # padded rows per token
    if layout.paths.experts_fp8 == "fused":
        return combine + round(rows * (fp8_copy(h, p) + (2 if gated else 1) * f * a + fp8_copy(f, p)))
    return combine + k * (h * a + act) + round(rows * (fp8_copy(h, p) + fp8_copy(f, p)))


def mamba_bytes(model: ModelConfig, layout: Layout, a: int) -> tuple[int, int]:
    """Mamba-2's mixer on the torch scans with --kernel-linear-scan-recompute on (model/mamba.py): (per token,
    per sequence) bytes on this rank, its heads and groups (TP). Per token: the convolution's output (silu's
    input), the scan's fp32 inputs x, B, C and dt, softplus's input, the gate's fp32 z (in fp32 the whole in_proj
    output it is a view of), the gated norm's y and gate, its input, statistic and output, out_proj's input,
    the convolution's input (padded: taps - 1 rows more per sequence). Under context parallelism the same bytes:
    this rank's tokens' share of the whole sequence's tensors of 1/CP of the heads."""
    t, p = layout.tp, model.mamba_head_dim
    heads, groups = mamba_heads(model) // t, model.mamba_num_groups // t
    di, bc = heads * p, groups * model.mamba_state_dim
    conv = di + 2 * bc
    z = (2 * di + 2 * bc + heads) * FP32 if a == FP32 else di * FP32
    per_token = 2 * conv * a + conv * FP32 + 2 * heads * FP32 + z + 4 * di * FP32 + groups * FP32 + di * a
    c = layout.cp  # under CP the convolution and the scan run on the whole sequence of 1/CP of the heads
    fixed = (CONV_WIDTH - 1) * conv // c * a
    if not layout.paths.scan_recompute:  # the scan's own tensors; the per-group fp32 B, C copies then unkept
        fixed += ssd_kept(model, layout, heads // c) - layout.seq_length * (2 * bc // c * FP32 if a != FP32 else 0)
    return per_token, fixed


def chunking(chunk: int, s: int) -> tuple[int, int]:
    """(chunk length, chunks) of a chunked torch scan over ``s`` positions (kernels/ssd._chunks: padded to whole
    chunks)."""
    q = min(chunk, s)
    return q, -(-s // q)


def ssd_kept(model: ModelConfig, layout: Layout, heads: int) -> int:
    """Per sequence: what kernels/ssd.ssd_chunked saves with --kernel-linear-scan-recompute off, beside its inputs
    (x, dt, A kept anyway). Per (padded) position, in fp32: the decays L, the C.B scores and their product with L
    ([chunk] per head each), five per-head copies of B or C and products of them ([state] per head), three of
    x dt ([head dim] per head), the decay from the chunk's start (and its mask, a byte); per chunk: the state
    entering it and its copy stacked for the output ([head dim x state] per head)."""
    p, n = model.mamba_head_dim, model.mamba_state_dim
    q, chunks = chunking(model.mamba_chunk_size, layout.seq_length)
    per_position = (3 * q + 5 * n + 3 * p + 1) * heads * FP32 + heads
    return chunks * q * per_position + chunks * 2 * heads * p * n * FP32


def gdn_bytes(model: ModelConfig, layout: Layout, a: int) -> tuple[int, int]:
    """Gated DeltaNet's mixer on the torch scans with recomputation (model/gated_delta_net.py), as mamba_bytes:
    per token the convolution's output, its fp32 silu output, the L2 norms' statistics, the repeated q and k, the
    decay's and beta's fp32 pieces, the gate's fp32 z, the per-head norm's input, statistic, output, product and
    gate, out_proj's input, the convolution's (padded) input."""
    t, dk = layout.tp, model.linear_key_head_dim
    nk, nv = model.linear_num_key_heads // t, model.linear_num_value_heads // t
    qk, v = nk * dk, nv * model.linear_value_head_dim
    conv = 2 * qk + v
    z = (2 * qk + 2 * v + 2 * nv) * FP32 if a == FP32 else v * FP32
    per_token = 2 * conv * a + conv * FP32 + (2 * nk + 5 * nv + 2 * nv * dk) * FP32 + z + 4 * v * FP32 + v * a
    c = layout.cp  # under CP the convolution and the rule run on the whole sequence of 1/CP of the heads
    fixed = (model.linear_conv_kernel_dim - 1) * conv // c * a
    if not layout.paths.scan_recompute:  # the rule's own tensors; the repeated queries and the decays then unkept
        fixed += gated_delta_kept(model, layout, nv // c) - layout.seq_length * (nv // c) * (dk + 1) * FP32
    return per_token, fixed


def gated_delta_kept(model: ModelConfig, layout: Layout, nv: int) -> int:
    """Per sequence: what kernels/gated_delta.gated_delta_chunked saves with --kernel-linear-scan-recompute off,
    beside its inputs. Per (padded) position and value head, in fp32: seven [chunk] rows (the decays, k.k and
    q.k scores, their masked and beta-scaled products, the triangular system, the loop's score copies), seven
    [key dim] (the matmuls' copies of q and k, the scaled q, the triangular solve for the keys, the keys decayed
    to the chunk's end), two [value dim] (the solve for the values, the updates), two scalars (the decay from
    the chunk's start, times beta) and a byte (its mask); per chunk the state entering it, and from the second
    chunk on two [chunk x key dim] copies (the keys' solve sliced, the decayed queries)."""
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    q, chunks = chunking(gdn_chunk_size(model), layout.seq_length)
    per_position = (7 * q + 7 * dk + 2 * dv + 2) * nv * FP32 + nv
    copies = 2 if layout.micro_batch > 1 else 1  # a one-row batch's solve is sliced without a copy
    return chunks * q * per_position + (chunks * dk * dv + (chunks - 1) * copies * q * dk) * nv * FP32


LINEAR_MIXERS = {"mamba": mamba_bytes, "gdn": gdn_bytes}


def layer_bytes(model: ModelConfig, layout: Layout, kind: tuple, points: frozenset = frozenset(),
                decoder: bool = True) -> LayerBytes:
    """One layer of ``kind`` (mixer, MLP) (shapes.layer_kinds), one micro-batch, this rank; ``points``: its
    offloaded points (what they move to the host is not counted); ``decoder``: a decoder layer, which the
    --recompute-modules other than core_attn apply to (multi-token prediction's layers take only that one)."""
    a, h, t = layout.param_bytes, model.hidden_size, layout.tp
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    mixer, ffn = kind
    recomputes = (lambda name: layout.recomputes(name)) if decoder else (lambda name: False)
    blocks = (mixer is not None) + (ffn is not None)  # each pre-normed (and dropped out) on its own
    sp = blocks * (norm_bytes(model, a, layout.paths) + (h if model.hidden_dropout > 0 else 0))
    # the QKV and fc1 (router, in_proj) matmuls' inputs, all-gathered first under SP (FP8: their FP8 copies; the
    # router's input stays in bf16); --recompute-modules layernorm: the norm's output, when the matmul keeps it
    # (not an all-gathered or FP8 copy, not an input a checkpoint holds), recomputed instead
    qkv_in, fc1_in = (fp8_copy(h, layout.paths) if fp8 else h * a
                      for fp8 in (layout.paths.fp8_qkv, layout.paths.fp8_inputs))
    norm_out = recomputes("layernorm") and not layout.sequence_parallel and not layout.paths.fp8_qkv
    mlp_norm_out = recomputes("layernorm") and not layout.sequence_parallel and not layout.paths.fp8_inputs
    checkpointed = recomputes("moe") if ffn == "moe" else recomputes("mlp") and ffn is not None
    inputs, split, own, fixed = 0, 0, 0, 0
    if mixer == "attention":
        inputs, split = (0 if norm_out else qkv_in), attention_bytes(model, layout, a)
    elif mixer is not None:
        own, fixed = LINEAR_MIXERS[mixer](model, layout, a)
        inputs += 0 if recomputes("layernorm") and not layout.sequence_parallel else h * a
    if ffn == "moe":
        inputs += 0 if recomputes("layernorm") and not checkpointed else h * a
        own += 0 if checkpointed else moe_bytes(model, layout, a) - recomputed_moe_bytes(model, layout, a, recomputes)
    elif ffn is not None:
        inputs += 0 if mlp_norm_out and not checkpointed else fc1_in
        own += 0 if checkpointed else mlp_bytes(model, model.ffn_hidden_size, a, layout.paths) // t
    if checkpointed and model.hidden_dropout == 0 and model.normalization == "RMSNorm" and a < FP32 and \
            not layout.paths.quack_norm:  # the checkpoint holds the residual, which the norm keeps in fp32 only
        own += h * a // (t if layout.sequence_parallel else 1)
    per_token = (sp // t if layout.sequence_parallel else sp) + inputs + split // t + own
    keep = h * a // (t if layout.sequence_parallel else 1)
    moved = offloaded_bytes(model, layout, kind, points, tokens)
    return LayerBytes(tokens * per_token + layout.micro_batch * fixed - moved, tokens * keep)


def recomputed_moe_bytes(model: ModelConfig, layout: Layout, a: int, recomputes) -> int:
    """Per token: what --recompute-modules shared_experts (the shared expert's tensors) and moe_act (the activation's
    output, per routed copy) take out of moe_bytes."""
    out = 0
    if recomputes("shared_experts") and model.moe_shared_expert_intermediate_size:
        out += mlp_bytes(model, model.moe_shared_expert_intermediate_size, a, layout.paths.shared_mlp) // layout.tp
    if recomputes("moe_act"):
        f = model.moe_ffn_hidden_size // layout.etp
        out += model.moe_router_topk * f * a // (layout.tp if layout.sequence_parallel else 1)
    return out


def head_bytes(model: ModelConfig, layout: Layout, vocab: int) -> int:
    """The last stage's final norm, output matmul input and logits-sized loss tensor, one micro-batch."""
    a, t = layout.param_bytes, layout.tp
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    sp = norm_bytes(model, a, layout.paths)
    inputs = model.hidden_size * a  # the output layer's input, all-gathered under SP
    return tokens * ((sp // t if layout.sequence_parallel else sp) + inputs + vocab // t * a + 2 * INDEX)


def mtp_bytes(model: ModelConfig, layout: Layout, vocab: int) -> int:
    """Multi-token prediction's depths on the last stage, one micro-batch: per depth a layer of the last layer's
    kind, its own loss head, and per token the embedding's norm, the hidden state's norm (whose input, the decoder's
    normed output, is already kept: LayerNorm's input, or RMSNorm's in fp32), the 2h -> h projection's (gathered)
    input and the shifted labels. Full recomputation keeps a depth's embedded input instead of its layer."""
    if not model.mtp_num_layers:
        return 0
    a, h, t = layout.param_bytes, model.hidden_size, layout.tp
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    shared = h * a if model.normalization == "LayerNorm" else (h * FP32 if a == FP32 else 0)
    norms = 2 * norm_bytes(model, a, layout.paths) - shared
    per_token = (norms // t if layout.sequence_parallel else norms) + 2 * h * a + INDEX
    layer = layer_bytes(model, layout, layer_kinds(model)[-1], decoder=False).full
    if layout.recompute == "full":
        per_token, layer = h * a // (t if layout.sequence_parallel else 1) + INDEX, 0
    return model.mtp_num_layers * (layer + head_bytes(model, layout, vocab) + tokens * per_token)


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Micro-batches (interleaved: chunk micro-batches) whose activations a pipeline rank holds at once."""
    m = layout.microbatches
    if layout.vpp == 1:  # the turns of --overlap-moe-expert-parallel-comm: one more (parallel/turns.py)
        return min(layout.pp - pp_rank + (1 if layout.turns else 0), m)
    if m == layout.pp:  # Megatron's interleaved schedule: every chunk micro-batch is a warm-up one
        return m * layout.vpp
    turns = 1 if layout.turns else 0  # one more warm-up forward
    return min((layout.pp - pp_rank - 1) * 2 + (layout.vpp - 1) * layout.pp + 1 + turns, m * layout.vpp)


def edge_bytes(model: ModelConfig, layout: Layout, vocab: int, pre: bool, post: bool) -> int:
    """The embedding's dropout mask (first chunk) and the loss head (last chunk), one micro-batch."""
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    mask = tokens * model.hidden_size // (layout.tp if layout.sequence_parallel else 1)
    mtp = mtp_bytes(model, layout, vocab) if post else 0
    return (mask if pre and model.hidden_dropout > 0 else 0) + (head_bytes(model, layout, vocab) if post else 0) + mtp


def chunk_bytes(model: ModelConfig, layout: Layout, layers: list, vocab: int, pre: bool,
                post: bool, first: int = 0) -> tuple[int, int]:
    """(saved bytes of one micro-batch through this chunk, the backward's working set: the largest layer, or
    with full recomputation the largest group recomputed at once). ``layers``: the chunk's layer kinds
    (shapes.layer_kinds); full recomputation keeps inputs only (Megatron's --recompute-method uniform: every
    --recompute-num-layers layers one input; block: the first --recompute-num-layers layers' inputs, the
    others whole). ``first``: the global index of the chunk's first layer."""
    per = [layer_bytes(model, layout.at(first + i), kind) for i, kind in enumerate(layers)]
    if layout.recompute != "full" or not per:  # (offloading: the layers' tensors back for their backward)
        kept = [layer_bytes(model, layout.at(first + i), kind, points) for i, (kind, points) in
                enumerate(zip(layers, offload_points(model, layout, layers)))] if layout.offload_modules else per
        return sum(p.full for p in kept) + edge_bytes(model, layout, vocab, pre, post), \
            max((p.full for p in per), default=0)
    n = min(layout.recompute_num_layers or 1, len(per))  # (the model recomputes one layer at a time without it)
    if layout.recompute_method == "block":  # the first n layers recomputed, the rest kept whole
        saved, working = sum(p.input for p in per[:n]) + sum(p.full for p in per[n:]), max(p.full for p in per)
    else:  # uniform: groups of n layers, each keeping its first input; backward recomputes one group at a time
        groups = [per[i: i + n] for i in range(0, len(per), n)]
        saved, working = sum(g[0].input for g in groups), max(sum(p.full for p in g) for g in groups)
    return saved + edge_bytes(model, layout, vocab, pre, post), working
