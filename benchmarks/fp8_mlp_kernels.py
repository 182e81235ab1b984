"""Speed of the fused FP8 MLP's activation kernels (paratron/parallel/fp8_mlp.py) on one GPU: the
forward op (activation -> FP8 row-major + transposed) and the backward op (activation gradient -> FP8
row-major + transposed, bias gradient), for SwiGLU, GeLU and tanh GeLU, with and without fc1's bias,
with the tensor's own scale (tensorwise: amax pass + cast pass) and a preset one (delayed: the cast pass
alone), at the MLP shapes of gpt-350m (micro-batch 32) and llama-1b (micro-batch 16).

    python benchmarks/fp8_mlp_kernels.py            # prints a table, writes a record ($OUT or benchmarks/results)

GB/s counts the bytes each op must move at least once: fc1's output in bf16 (and the incoming gradient
for the backward) read, the FP8 output written twice (row-major and transposed; the op also reads the
row-major tile back, from L2, to store it transposed; not counted).
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.record import ROOT, cuda_ms, write_record  # noqa: E402
from paratron.parallel import fp8_mlp  # noqa: E402

SHAPES = {"gpt-350m": (32 * 2048, 4096), "llama-1b": (16 * 2048, 8192)}  # tokens, activation width
ACTS = {"swiglu": fp8_mlp.SWIGLU, "gelu": fp8_mlp.GELU, "gelu-tanh": fp8_mlp.GELU_TANH}


def measure(m: int, f: int, act: int, bias: bool, delayed: bool) -> tuple[float, float, float, float]:
    """(forward ms, GB/s, backward ms, GB/s)."""
    cols = 2 * f if act == fp8_mlp.SWIGLU else f
    h = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if bias else None
    d = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    preset = torch.tensor(10.0 if delayed else 0.0, device="cuda")
    fwd = cuda_ms(lambda: torch.ops.paratron.mlp_act_fp8(h, b, preset, act, 0))
    bwd = cuda_ms(lambda: torch.ops.paratron.mlp_act_fp8_backward(h, b, d, preset, act, True, 0))
    fwd_bytes = m * cols * 2 + 2 * m * f
    bwd_bytes = m * cols * 2 + m * f * 2 + 2 * m * cols
    return fwd, fwd_bytes / fwd / 1e6, bwd, bwd_bytes / bwd / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_mlp_kernels.py needs a CUDA GPU (the Triton kernels)")
    rows = ["| shape | activation | fc1 bias | scale | forward ms | GB/s | backward ms | GB/s |", "|---" * 8 + "|"]
    for shape, (m, f) in SHAPES.items():
        for name, act in ACTS.items():
            for bias in (False, True):
                for delayed in (False, True):
                    r = measure(m, f, act, bias, delayed)
                    rows.append(f"| {shape} ({m} x {f}) | {name} | {'yes' if bias else 'no'} | "
                                f"{'preset (delayed)' if delayed else 'own amax'} | {r[0]:.3f} | {r[1]:.0f} | "
                                f"{r[2]:.3f} | {r[3]:.0f} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    write_record(args.record_dir, "fp8_mlp_kernels", "fused FP8 MLP activation kernels",
                 torch.cuda.get_device_name(), {"method": "CUDA events, mean of 20 calls after 3 warm-up calls"},
                 table)


if __name__ == "__main__":
    main()
