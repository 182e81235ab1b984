"""The rotary embedding around FlashAttention-4 at llama-1b's attention shape, timed alone on the GPU: Inductor's
compiled rotation (the QKV view's q and k rotated; backward from dq, dk, dv to the QKV gradient) against the two
Triton kernels of paratron/model/rope_kernels.py, with the bytes each moves and the rate; then attention forward
+ backward both ways (compiled ``apply_rotary`` + ``causal_attention`` against ``rotary_causal_attention``).
Writes a record.

    python benchmarks/rope_flash_bench.py        (on the device: . benchmarks/quack_env.sh first)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from record import cuda_ms, write_record  # noqa: E402
from paratron.model import flash_attention, rope_kernels  # noqa: E402
from paratron.model.layers import apply_rotary  # noqa: E402


def _inductor_rotation(qpg: int, with_v: bool):
    """Compiled q and k of the QKV view rotated; ``with_v``: also v, copied, so that its gradient's way into the
    QKV gradient is in the compiled backward too (as in the layer, where v goes into the attention op)."""
    def rotate(qkv5, cos, sin):
        s, b, groups = qkv5.shape[:3]
        q = qkv5[:, :, :, :qpg].reshape(s, b, groups * qpg, -1)
        out = apply_rotary(q, cos, sin), apply_rotary(qkv5[:, :, :, -2], cos, sin)
        return (*out, qkv5[:, :, :, -1].clone()) if with_v else out
    return torch.compile(rotate, fullgraph=True)


def _attention(qpg: int, fused: bool):
    def unfused(qkv5, cos, sin):
        s, b, groups = qkv5.shape[:3]
        q = qkv5[:, :, :, :qpg].reshape(s, b, groups * qpg, -1)
        return flash_attention.causal_attention(apply_rotary(q, cos, sin), apply_rotary(qkv5[:, :, :, -2], cos, sin),
                                                qkv5[:, :, :, -1])
    return torch.compile(
        (lambda qkv5, cos, sin: flash_attention.rotary_causal_attention(qkv5, cos, sin, None, qpg)) if fused
        else unfused, fullgraph=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--shape", default="16,2048,8,4,64", help="micro-batch,seq,groups,queries per group,head dim")
    p.add_argument("--sweep", action="store_true", help="also the kernels at other BLOCK_T / num_warps")
    args = p.parse_args()
    b, s, groups, qpg, d = (int(x) for x in args.shape.split(","))
    qkv5 = torch.randn(s, b, groups, qpg + 2, d, device="cuda").bfloat16().requires_grad_()
    ang = torch.outer(torch.arange(s, device="cuda").float(), torch.rand(d // 2, device="cuda"))
    cos, sin = (f(torch.cat([ang, ang], -1))[:, None, None, :] for f in (torch.cos, torch.sin))
    c2, s2 = cos.view(s, d), sin.view(s, d)
    heads, elt = groups * qpg, 2
    dq = torch.randn(s, b, heads, d, device="cuda").bfloat16()
    dk, dv = torch.randn(2, s, b, groups, d, device="cuda").bfloat16()
    dqkv = torch.zeros_like(qkv5.detach())
    rows = ["| pass | ms | GB moved | TB/s |", "|---|---|---|---|"]

    def row(name, ms, nbytes):
        rows.append(f"| {name} | {ms:.4f} | {nbytes / 1e9:.3f} | {nbytes / ms / 1e9:.2f} |")
        print(rows[-1], flush=True)

    qkv_rot = (heads + groups) * s * b * d * elt  # the query and key heads once
    rot = _inductor_rotation(qpg, False)
    row("Inductor rotation forward", cuda_ms(lambda: rot(qkv5, cos, sin)), 2 * qkv_rot)
    outs = _inductor_rotation(qpg, True)(qkv5, cos, sin)
    row("Inductor rotation backward (dq, dk, dv -> dqkv)",
        cuda_ms(lambda: torch.autograd.grad(outs, qkv5, (dq, dk, dv), retain_graph=True)),
        2 * qkv_rot + 2 * groups * s * b * d * elt)
    default = (rope_kernels.BLOCK_T, rope_kernels.NUM_WARPS)
    for block_t, warps in ([default] + [(t, w) for t in (16, 32, 64, 128) for w in (2, 4, 8)
                                        if (t, w) != default] * args.sweep):
        rope_kernels.BLOCK_T, rope_kernels.NUM_WARPS = block_t, warps
        tag = f" (BLOCK_T {block_t}, {warps} warps)"
        row("rope_kernels.rotate_qk" + tag, cuda_ms(lambda: rope_kernels.rotate_qk(qkv5.detach(), c2, s2)), 2 * qkv_rot)
        row("rope_kernels.unrotate_into_" + tag, cuda_ms(lambda: rope_kernels.unrotate_into_(dqkv, dq, c2, s2)),
            2 * qkv_rot)
    rope_kernels.BLOCK_T, rope_kernels.NUM_WARPS = default
    dy = torch.randn(s, b, heads * d, device="cuda").bfloat16()
    att = ["", "| attention fwd + bwd | ms |", "|---|---|"]
    for name, fused in (("compiled apply_rotary + causal_attention", False), ("rotary_causal_attention", True)):
        fn = _attention(qpg, fused)
        ms = cuda_ms(lambda: torch.autograd.backward(fn(qkv5, cos, sin), dy))
        att.append(f"| {name} | {ms:.3f} |")
        print(att[-1], flush=True)
    body = "\n".join(rows + att) + ("\n\nGB moved: the bytes each pass must read and write at the least (bf16; "
                                    "Inductor's backward also moves dv).\n")
    write_record(args.record_dir, "rope_flash", "Rotary embedding around FlashAttention-4: Inductor vs two kernels",
                 torch.cuda.get_device_name(), {"shape": f"b{b} s{s} groups{groups} qpg{qpg} d{d}"}, body)


if __name__ == "__main__":
    main()
