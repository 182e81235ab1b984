"""TFLOP/s of every matmul of a preset's training step, timed alone on the GPU: for each linear
layer its forward (x @ W^T), input gradient (dy @ W) and weight gradient (dy^T @ x), with the
operand layouts the step uses and, for the weight gradient, the transposed formulation
((x^T @ dy)^T), so a slow cuBLAS choice shows up. Median of CUDA-event timings over fresh random
operands (several sets rotated so no run reads from a warm L2).

    python benchmarks/matmul_shapes.py --config llama-1b --tokens 32768
    python benchmarks/matmul_shapes.py --scans [--tokens 8192]   # Mamba-2 / Gated DeltaNet scans, fla vs torch
    python benchmarks/matmul_shapes.py --scan-memory [--tokens 512] [--device cpu]   # one hybrid layer's activations
    python benchmarks/matmul_shapes.py --config moe-mini --tokens 16384 --experts [--quack]   # routed experts
    python benchmarks/matmul_shapes.py --config llama-1b --tokens 32768 --fp8   # dense linears in FP8

``--scans``: the linear-recurrence scans of hybrid stacks (kernels/linear_scan.py) instead of the matmuls: Mamba-2's
SSD at hybrid-mini's heads (64 x 64, 8 groups, state 128) and the gated delta rule at Qwen3-Next's (32 value heads,
128 x 128), 4 packed documents per row, forward and forward + backward, fla-core's kernels (``--kernel-linear-scan
fla``) against the torch references (also with their recomputation, ``--kernel-linear-scan-recompute on``), with
the largest relative difference of outputs and gradients.

``--experts``: the routed experts' grouped GEMMs of one MoE layer (rows balanced over the experts, each group a
multiple of 128 rows): for fc1 and fc2 the forward, input gradient and weight gradient in bf16 (``torch._grouped_mm``)
and in each FP8 path from already quantised operands, then the whole FP8 experts' function (quantisation included)
forward and forward + backward against bf16's, per recipe; with ``--quack``, quack-kernels' variable-length GEMM on
the same products instead (bf16 and FP8, default tile and autotuned), each checked against torch's.
``--fp8``: each dense linear's three GEMMs in bf16, tensorwise FP8 (``torch._scaled_mm``) and blockwise FP8 (cuBLAS's
block-scaled GEMM, and DeepGEMM's where it runs: kernels/experimental/deepgemm.py) from quantised operands, and
each recipe's casts of the input and output gradient in both layouts (blockwise: compiled torch ops and the Triton
kernel). Both write a record (``expert_gemms_<config>...``).

``--scan-memory``: what one Mamba-2 and one Gated DeltaNet layer (hybrid-mini's shapes; Gated DeltaNet with
Megatron's default 16 key and 32 value heads of 128) keep for backward and their forward + backward time, torch
scans in fp32 with ``--kernel-linear-scan-recompute`` off and on, at ``--tokens`` (one row up to 2048, as --scans).
"saved" counts the distinct storages autograd saves during the forward (saved_tensors_hooks; the weights left
out); the time is the median of 3 passes, off and on interleaved; on CUDA also the peak memory of a pass. Writes a
record (benchmarks/record.py) to $OUT if set, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the linear layers of one transformer layer + output."""
    from paratron.config import parse_args
    cfg = parse_args(["--config", preset])
    m = cfg.model  # resolved: the derived sizes are filled
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.kv_channels
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * d
    return [("qkv", h, qkv), ("proj", m.num_attention_heads * d, h), ("fc1", h, f * (2 if m.swiglu else 1)),
            ("fc2", f, h), ("output", h, cfg.padded_vocab_size)]


def scan_inputs(kind: str, b: int, s: int, device, docs: int = 4):
    """Random inputs of one scan, ``ssd`` at hybrid-mini's head shapes or ``gdn`` at Qwen3-Next's, and the document
    starts of ``docs`` packed documents per row."""
    from paratron.kernels.ssd import resets_of
    f, sp = dict(device=device, dtype=torch.float32), torch.nn.functional.softplus
    ids = torch.arange(s, device=device)[None].expand(b, s) * docs // s
    if kind == "ssd":
        h, p, g, n = 64, 64, 8, 128
        x = dict(x=torch.randn(b, s, h, p, **f), dt=sp(torch.randn(b, s, h, **f) - 3), A=-torch.rand(h, **f) * 8,
                 B=torch.randn(b, s, g, n, **f), C=torch.randn(b, s, g, n, **f))
    else:
        h, d, unit = 32, 128, torch.nn.functional.normalize
        x = dict(q=unit(torch.randn(b, s, h, d, **f), dim=-1), k=unit(torch.randn(b, s, h, d, **f), dim=-1),
                 v=torch.randn(b, s, h, d, **f), g=-sp(torch.randn(b, s, h, **f)), beta=torch.rand(b, s, h, **f))
    return x, resets_of(ids)


def scans(tokens: int) -> None:
    """Forward and forward + backward ms of each scan on each available kernel, and the difference to torch's."""
    from paratron.kernels.linear_scan import fla_available, gated_delta, ssd
    dev = torch.device("cuda")
    b, s = max(tokens // 2048, 1), min(tokens, 2048)
    kernels = [("torch", False), ("torch", True)] + ([("fla", False)] if fla_available(dev) else [])
    print(f"{'scan':5s} {'kernel':9s} {'batch x seq':>12s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'max rel. diff':>14s}")
    for kind, fn in (("ssd", ssd), ("gdn", gated_delta)):
        x, reset = scan_inputs(kind, b, s, dev)
        ref = None
        for k, again in kernels:
            leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
            y = fn(**leaves, reset=reset, kernel=k, recompute=again)[0]
            outs = [y.detach(), *torch.autograd.grad((y * y).sum(), list(leaves.values()))]
            ref = ref or outs
            diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(outs, ref))
            fwd = time_ms(lambda: fn(**leaves, reset=reset, kernel=k), [()])
            both = time_ms(lambda: torch.autograd.grad(fn(**leaves, reset=reset, kernel=k, recompute=again)[0].sum(),
                                                       list(leaves.values())), [()])
            name = k + ("+rec" if again else "")
            print(f"{kind:5s} {name:9s} {f'{b}x{s}':>12s} {fwd:8.3f} {both:11.3f} {diff:14.2e}")


def _layer_saved_bytes(layer, x) -> int:
    """Bytes of the distinct storages autograd saves in ``layer``'s forward, its weights left out."""
    from paratron.model.context import ForwardContext
    from paratron.model.recompute import saved_storage_bytes
    return saved_storage_bytes(lambda: layer(x, ForwardContext()), skip=list(layer.parameters()))[0]


def _layer_pass(layer, x) -> float:
    """Seconds of one forward + backward of ``layer``."""
    import time
    from paratron.model.context import ForwardContext
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    layer(x, ForwardContext()).square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def scan_memory(tokens: int, device: str, reps: int = 3) -> list[str]:
    """The --scan-memory table's rows: per layer and recomputation, saved MiB, median fwd+bwd ms (peak MiB)."""
    import dataclasses
    import statistics
    from paratron.config import ModelConfig
    from paratron.model.context import Parallel
    from paratron.model.gated_delta_net import GatedDeltaNet
    from paratron.model.mamba import MambaMixer
    b, s = max(tokens // 2048, 1), min(tokens, 2048)
    cfg = ModelConfig(hybrid_layer_pattern="MG", hidden_size=2048, num_attention_heads=16, seq_length=s,
                      mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, normalization="RMSNorm",
                      position_embedding_type="none", disable_bias_linear=True, hidden_dropout=0.0,
                      attention_dropout=0.0, linear_num_key_heads=16, linear_num_value_heads=32).resolved()
    cuda = torch.device(device).type == "cuda"
    rows = ["| layer | recompute | saved MiB | fwd+bwd ms |" + (" peak MiB |" if cuda else ""),
            "|---" * (5 if cuda else 4) + "|"]
    for cls in (MambaMixer, GatedDeltaNet):
        layers, times = {}, {"off": [], "on": []}
        for again in times:
            torch.manual_seed(0)
            k = dataclasses.replace(Parallel().kernels, kernel_linear_scan="torch", kernel_linear_scan_recompute=again)
            layers[again] = cls(cfg, Parallel(kernels=k), device=device)
        x = torch.randn(s, b, 2048, device=device, requires_grad=True)
        for _ in range(reps + 1):  # the first pass of each warms up
            for again, layer in layers.items():
                times[again].append(_layer_pass(layer, x))
        for again, layer in layers.items():
            peak = ""
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                _layer_pass(layer, x)
                peak = f" {torch.cuda.max_memory_allocated() / 2**20:.0f} |"
            rows.append(f"| {cls.__name__} | {again} | {_layer_saved_bytes(layer, x) / 2**20:.1f} | "
                        f"{statistics.median(times[again][1:]) * 1e3:.0f} |{peak}")
            print(rows[-1], flush=True)
    return rows


def scan_memory_record(tokens: int, device: str) -> None:
    import os
    from benchmarks.record import write_record
    rows = scan_memory(tokens, device)
    cuda = torch.device(device).type == "cuda"
    write_record(os.environ.get("OUT") or Path(__file__).resolve().parent / "results", "scan_memory",
                 "One hybrid layer's saved activations and time, torch scans, recomputation off / on",
                 torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads",
                 {"shape": f"{tokens} tokens, fp32 scans"}, "\n".join(rows))


def time_ms(fn, operand_sets, reps: int = 20) -> float:
    for ops in operand_sets[:2]:
        fn(*ops)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        ops = operand_sets[i % len(operand_sets)]
        starts[i].record()
        fn(*ops)
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]


def _quack_cases(cases):
    """The same products on quack's GEMM (A [M, K] @ B [K, N], any strides), default tile and autotuned."""
    from quack.gemm_interface import gemm
    forms = {"forward x@W^T": lambda x, w, dy: (x, w.t()), "input grad dy@W": lambda x, w, dy: (dy, w),
             "weight grad dy^T@x": lambda x, w, dy: (dy.t(), x)}
    out = []
    for what, _, dims in cases:
        if what in forms:
            for tuned in (False, True):
                out.append((f"quack{'*' if tuned else ''} {what}"[:22],
                            lambda x, w, dy, f=forms[what], t=tuned: gemm(*f(x, w, dy), tuned=t), dims))
    return out


def expert_shapes(preset: str, tokens: int):
    """(experts, routed rows, [(name, in_features, out_features)]) of one MoE layer of ``preset``."""
    from paratron.config import parse_args
    m = parse_args(["--config", preset]).model
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    return m.num_experts, tokens * m.moe_router_topk, [("fc1", m.hidden_size, f * (2 if m.swiglu else 1)),
                                                      ("fc2", f, m.hidden_size)]


def recipes():
    from paratron.fp8.recipe import Recipe
    return [("tensorwise e4m3", Recipe(format="e4m3", grouped_gemm="scaled_grouped_mm")),
            ("tensorwise hybrid", Recipe(format="hybrid", grouped_gemm="scaled_grouped_mm")),
            ("tensorwise dequant", Recipe(format="e4m3", grouped_gemm="dequant")),
            ("blockwise dequant", Recipe(format="e4m3", recipe="blockwise")),
            ("blockwise triton", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="triton")),
            ("blockwise triton, triton wgrad", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="triton",
                                                      block_grouped_wgrad="triton")),
            *([("blockwise deepgemm", Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="deepgemm")),
               ("blockwise deepgemm, triton wgrad",
                Recipe(format="e4m3", recipe="blockwise", block_grouped_gemm="deepgemm", block_grouped_wgrad="triton"))]
              if _deepgemm() else [])]


def _deepgemm() -> bool:
    """Whether DeepGEMM's GEMMs run here (its rows are left out otherwise: its ops would measure the fallback)."""
    from paratron.kernels.experimental import deepgemm
    return deepgemm.refusal("cuda") is None


def _tensorwise(x, w, g) -> tuple:
    """The tensorwise e4m3 operands of one GEMM's three products, as the FP8 linears quantise them:
    (state, x and x^T with their scale, the weight with its scale, g and g^T with their scale)."""
    from paratron.fp8.recipe import FP8State, Recipe
    st = FP8State(Recipe(format="e4m3"), x.device)
    return (st, *st.input.quantize_both(x), *st.quantize("weight", w), *st.quantize_grad(g))


def kernel_cases(x, w, g, ends):
    """(label, fn, flops) of each GEMM kernel on operands quantised beforehand."""
    from paratron.fp8.experts import transposed_blocks, weight_blocks
    from paratron.kernels.fp8_block import quantize_tiles
    from paratron.kernels.fp8_grouped import grouped_forward, grouped_wgrad
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[1]
    cases = [("bf16 forward", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), flops),
             ("bf16 input grad", lambda: torch._grouped_mm(g, w, offs=ends), flops),
             ("bf16 weight grad", lambda: torch._grouped_mm(g.t(), x, offs=ends), flops)]
    _, xq, xtq, sx, wq, sw, gq, gtq, sg = _tensorwise(x, w, g)
    wtq = wq.transpose(1, 2).contiguous()
    for path in ("scaled_grouped_mm", "dequant"):
        cases += [(f"tensor {path} fwd", lambda p=path: grouped_forward(xq, sx, wq, sw, ends, "tensor", x.dtype, p),
                   flops),
                  (f"tensor {path} dgrad", lambda p=path: grouped_forward(gq, sg, wtq, sw, ends, "tensor", x.dtype, p),
                   flops),
                  (f"tensor {path} wgrad", lambda p=path: grouped_wgrad(gtq, sg, xtq, sx, ends, "tensor", x.dtype, p),
                   flops)]
    bx, bsx = quantize_tiles(x)
    bxt, bsxt = quantize_tiles(x.t())
    bg, bsg = quantize_tiles(g)
    bgt, bsgt = quantize_tiles(g.t())
    bw, bsw = weight_blocks(w, 0)
    bwt, bswt = transposed_blocks(bw, bsw)
    for path in (("deepgemm",) if _deepgemm() else ()) + ("triton", "dequant"):
        cases += [(f"block {path} fwd", lambda p=path: grouped_forward(bx, bsx, bw, bsw, ends, "block", x.dtype, p),
                   flops),
                  (f"block {path} dgrad", lambda p=path: grouped_forward(bg, bsg, bwt, bswt, ends, "block", x.dtype, p),
                   flops)]
    for path in ("triton", "dequant"):
        cases.append((f"block {path} wgrad",
                      lambda p=path: grouped_wgrad(bgt, bsgt, bxt, bsxt, ends, "block", x.dtype, p), flops))
    return cases


def quack_cases(x, w, g, ends, tuned: bool):
    """quack-kernels' variable-length GEMM (CuTe DSL; its FP8 operands K-major) on the same products: bf16 and
    FP8 with the tensorwise scales as one alpha."""
    from quack.gemm_interface import gemm
    flops, cu = 2 * x.shape[0] * x.shape[1] * w.shape[1], torch.cat([ends.new_zeros(1), ends])
    _, xq, xtq, sx, wq, sw, gq, gtq, sg = _tensorwise(x, w, g)
    wtq = wq.transpose(1, 2).contiguous()
    a_fwd, a_dgrad, a_wgrad = (1 / (sx * sw)).float(), (1 / (sg * sw)).float(), (1 / (sg * sx)).float()
    t = "*" if tuned else ""
    return [(f"quack{t} bf16 fwd", lambda: gemm(x, w.transpose(1, 2), cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} bf16 dgrad", lambda: gemm(g, w, cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} bf16 wgrad", lambda: gemm(g.t(), x, cu_seqlens_k=cu, tuned=tuned), flops),
            (f"quack{t} fp8 fwd", lambda: gemm(xq, wq.transpose(1, 2), alpha=a_fwd, out_dtype=x.dtype,
                                               cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} fp8 dgrad", lambda: gemm(gq, wtq.transpose(1, 2), alpha=a_dgrad, out_dtype=x.dtype,
                                                 cu_seqlens_m=cu, tuned=tuned), flops),
            (f"quack{t} fp8 wgrad", lambda: gemm(gtq, xtq.t(), alpha=a_wgrad, out_dtype=x.dtype, cu_seqlens_k=cu,
                                                 tuned=tuned), flops)]


def function_cases(x, w, g, ends):
    """(label, forward fn, forward + backward fn) of the experts' whole GEMM per recipe, quantisation included."""
    from paratron.fp8.experts import fp8_grouped_mm
    from paratron.fp8.recipe import FP8State

    def bf16():
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    out = [("bf16", bf16, lambda: torch.autograd.grad(bf16(), (x, w), g))]
    for label, recipe in recipes():
        state = FP8State(recipe, x.device)
        fwd = (lambda s=state: fp8_grouped_mm(x, w, ends, s))
        out.append((label, fwd, lambda f=fwd: torch.autograd.grad(f(), (x, w), g)))
    return out


def dense_cases(x, w, g):
    """(label, fn, flops) of one dense linear's three GEMMs in bf16, tensorwise FP8 (``torch._scaled_mm``) and
    blockwise FP8 (cuBLAS's block-scaled GEMM), from operands quantised beforehand, and the casts each recipe
    makes of the input and the output gradient (compiled, as under --torch-compile): row-major and transposed."""
    from paratron.fp8.recipe import column_major, scaled_mm
    from paratron.kernels.fp8_block import block_mm, quantize_blocks, quantize_tiles
    from paratron.kernels.fp8_tile_cast import tiles_both
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    st, xq, xtq, sx, wq, sw, gq, gtq, sg = _tensorwise(x, w, g)
    wcm, bxq, bsx = column_major(wq), *quantize_tiles(x)
    bxt, bsxt = quantize_tiles(x.t())
    bgq, bsg = quantize_tiles(g)
    bgt, bsgt = quantize_tiles(g.t())
    bw, bsw = quantize_blocks(w)
    both = torch.compile(lambda t: (quantize_tiles(t), quantize_tiles(t.t())))
    return [("bf16 fwd", lambda: x @ w.t(), flops), ("bf16 dgrad", lambda: g @ w, flops),
            ("bf16 wgrad", lambda: g.t() @ x, flops),
            ("tensor fwd", lambda: scaled_mm(xq, wq.t(), sx, sw, x.dtype, False), flops),
            ("tensor dgrad", lambda: scaled_mm(gq, wcm, sg, sw, x.dtype, False), flops),
            ("tensor wgrad", lambda: scaled_mm(gtq, xtq.t(), sg, sx, x.dtype, False), flops),
            ("block fwd", lambda: block_mm(bxq, bsx, bw, bsw, True, x.dtype, "scaled_mm"), flops),
            ("block dgrad", lambda: block_mm(bgq, bsg, bw.t(), bsw.t(), True, x.dtype, "scaled_mm"), flops),
            ("block wgrad", lambda: block_mm(bgt, bsgt, bxt, bsxt, False, x.dtype, "scaled_mm"), flops),
            *([("block deepgemm fwd", lambda: block_mm(bxq, bsx, bw, bsw, True, x.dtype, "deepgemm"), flops),
               ("block deepgemm dgrad", lambda: block_mm(bgq, bsg, bw.t(), bsw.t(), True, x.dtype, "deepgemm"), flops),
               ("block deepgemm wgrad", lambda: block_mm(bgt, bsgt, bxt, bsxt, False, x.dtype, "deepgemm"), flops)]
              if _deepgemm() else []),
            ("tensor cast x (+x^T)", lambda: st.input.quantize_both(x), 0),
            ("tensor cast g (+g^T)", lambda: st.quantize_grad(g), 0),
            ("block cast x (+x^T), compiled", lambda: both(x), 0),
            ("block cast g (+g^T), compiled", lambda: both(g), 0),
            ("block cast x (+x^T), triton", lambda: tiles_both(x, 0, "triton"), 0),
            ("block cast g (+g^T), triton", lambda: tiles_both(g, 0, "triton"), 0)]


def _time_case(name: str, label: str, fn):
    """The median ms of ``fn``, or None (said on one line) where this GPU or torch lacks its path."""
    try:
        return time_ms(fn, [()])
    except Exception as e:
        print(f"| {name} | {label} | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)
        return None


def dense(preset: str, tokens: int) -> list[str]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    lines = ["| linear | what | ms | TFLOP/s |", "|---|---|---|---|"]
    for name, fin, fout in shapes(preset)[:-1]:  # (the output layer stays in bf16 under FP8)
        torch.manual_seed(0)
        x, w = torch.randn(tokens, fin, device=dev, dtype=dt), torch.randn(fout, fin, device=dev, dtype=dt) / fin ** .5
        g = torch.randn(tokens, fout, device=dev, dtype=dt)
        for label, fn, flops in dense_cases(x, w, g):
            ms = _time_case(name, label, fn)
            if ms is None:
                continue
            lines.append(f"| {name} {tokens}x{fin}->{fout} | {label} | {ms:.3f} | "
                         f"{f'{flops / ms / 1e9:.0f}' if flops else ''} |")
            print(lines[-1], flush=True)
    return lines


def run(preset: str, tokens: int, quack: bool = False) -> list[str]:
    experts, rows, gemms = expert_shapes(preset, tokens)
    per = rows // experts // 128 * 128
    dev, dt = torch.device("cuda"), torch.bfloat16
    ends = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * per
    s = per * experts
    lines = ["| GEMM | what | ms | TFLOP/s |", "|---|---|---|---|"]
    for name, k, n in gemms:
        torch.manual_seed(0)
        x = torch.randn(s, k, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(experts, n, k, device=dev, dtype=dt) * k ** -0.5).requires_grad_(True)
        g = torch.randn(s, n, device=dev, dtype=dt)
        xd, wd = x.detach(), w.detach()
        cases = ([c for tuned in (False, True) for c in quack_cases(xd, wd, g, ends, tuned)] if quack
                 else kernel_cases(xd, wd, g, ends))
        refs = {"fwd": lambda: torch._grouped_mm(xd, wd.transpose(-2, -1), offs=ends),
                "dgrad": lambda: torch._grouped_mm(g, wd, offs=ends),
                "wgrad": lambda: torch._grouped_mm(g.t(), xd, offs=ends)}
        for label, fn, flops in cases:
            ms = _time_case(name, label, fn)
            if ms is None:
                continue
            if quack:  # the product checked against torch's bf16 grouped GEMM
                ref = refs[label.split()[-1]]().float()
                label += f" (rel. diff {((fn().float() - ref).norm() / ref.norm()).item():.1e})"
            lines.append(f"| {name} {s}x{k}->{n}, {experts} experts | kernel: {label} | {ms:.3f} | "
                         f"{flops / ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
        flops = 2 * s * k * n
        for label, fwd, both in ([] if quack else function_cases(x, w, g, ends)):
            f_ms, b_ms = time_ms(fwd, [()]), time_ms(both, [()])
            lines.append(f"| {name} | function: {label} forward | {f_ms:.3f} | {flops / f_ms / 1e9:.0f} |")
            lines.append(f"| {name} | function: {label} fwd+bwd | {b_ms:.3f} | {3 * flops / b_ms / 1e9:.0f} |")
            print(*lines[-2:], sep="\n", flush=True)
        del x, w, g
        torch.cuda.empty_cache()
    return lines


def fp8_record(args) -> None:
    """--experts / --fp8: the table printed and written as a record ($OUT, else benchmarks/results/)."""
    import os
    from benchmarks.record import write_record
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {args.config}, {args.tokens} tokens")
    lines = run(args.config, args.tokens, args.quack) if args.experts else dense(args.config, args.tokens)
    kind = ("_quack" if args.quack else "") if args.experts else "_dense"
    what = "routed experts" if args.experts else "dense linears"
    write_record(os.environ.get("OUT") or Path(__file__).resolve().parent / "results",
                 f"expert_gemms_{args.config}{kind}", f"The {what}' GEMMs of {args.config}, bf16 and FP8, alone",
                 torch.cuda.get_device_name(), {"tokens per micro-batch": args.tokens}, "\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (micro-batch x sequence)")
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--blas", choices=["cublas", "cublaslt"], default=None, help="torch's preferred BLAS library")
    p.add_argument("--scans", action="store_true", help="time the hybrid stacks' scans (fla vs torch) instead")
    p.add_argument("--scan-memory", action="store_true",
                   help="one hybrid layer's saved activations and time, scan recomputation off / on, instead")
    p.add_argument("--device", default="cuda", help="--scan-memory's device (cpu or cuda)")
    p.add_argument("--quack", action="store_true",
                   help="also time quack-kernels' GEMM on each case (its default tile, and autotuned); with "
                        "--experts: its variable-length GEMM instead, bf16 and FP8")
    p.add_argument("--experts", action="store_true", help="the routed experts' grouped GEMMs (bf16 and each FP8 path; "
                   "kernels alone and whole functions) instead")
    p.add_argument("--fp8", action="store_true", help="the dense linears' GEMMs and casts in bf16, tensorwise and "
                   "blockwise FP8 instead")
    args = p.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.scan_memory:
        scan_memory_record(args.tokens, args.device)
        return 0
    if args.experts or args.fp8:
        fp8_record(args)
        return 0
    if args.scans:
        print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; scans, {args.tokens} tokens")
        scans(args.tokens)
        return 0
    dev, dt, n = "cuda", torch.bfloat16, args.tokens
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {args.config}, {n} tokens; "
          f"BLAS {torch.backends.cuda.preferred_blas_library()}")
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    b = torch.randn(8192, 8192, device=dev, dtype=dt)
    ms = time_ms(torch.mm, [(a, b)])
    print(f"reference 8192^3 matmul: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
    print(f"{'layer':8s} {'what':22s} {'M x K x N':>22s} {'ms':>8s} {'TFLOP/s':>8s}")
    total_ms = 0.0
    for name, fin, fout in shapes(args.config):
        sets = [(torch.randn(n, fin, device=dev, dtype=dt), torch.randn(fout, fin, device=dev, dtype=dt),
                 torch.randn(n, fout, device=dev, dtype=dt)) for _ in range(args.sets)]
        cases = [("forward x@W^T", lambda x, w, dy: x @ w.t(), (n, fin, fout)),
                 ("input grad dy@W", lambda x, w, dy: dy @ w, (n, fout, fin)),
                 ("weight grad dy^T@x", lambda x, w, dy: dy.t() @ x, (fout, n, fin)),
                 ("weight grad (x^T@dy)^T", lambda x, w, dy: (x.t() @ dy).t(), (fin, n, fout))]
        best_wgrad = None
        if args.quack:
            cases += _quack_cases(cases)
        for what, fn, (mm, kk, nn) in cases:
            ms = time_ms(fn, sets)
            tflops = 2 * mm * kk * nn / ms / 1e9
            print(f"{name:8s} {what:22s} {f'{mm}x{kk}x{nn}':>22s} {ms:8.3f} {tflops:8.0f}")
            if what.startswith("quack"):
                continue
            if what.startswith("weight"):
                best_wgrad = ms if best_wgrad is None else min(best_wgrad, ms)
            else:
                total_ms += ms
        total_ms += best_wgrad
        if name == "output":  # the cross-entropy's chunk when it recomputes (eager/CPU, or an over-large buffer)
            chunk = max(1, 2**28 // (4 * fout))
            ms = time_ms(lambda x, w, dy: x[:chunk] @ w.t(), sets)
            print(f"{name:8s} {'forward, one CE chunk':22s} {f'{chunk}x{fin}x{fout}':>22s} {ms:8.3f} "
                  f"{2 * chunk * fin * fout / ms / 1e9:8.0f}")
        del sets
        torch.cuda.empty_cache()
    print(f"sum over one layer + output layer (best weight-grad form): {total_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
