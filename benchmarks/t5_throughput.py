"""T5 training throughput on one GPU: paratron's T5Model beside transformers' T5ForConditionalGeneration compiled with
torch.compile, the same model (T5 v1.1 layout: relative buckets, RMSNorm, gated GeLU, no biases, untied head, the
sizes of Megatron's examples/t5/train_t5_220m_distributed.sh), the same batch and the same numerics (bf16 weights
and activations, torch's AdamW on the bf16 weights on both sides).

    python benchmarks/t5_throughput.py [--micro-batch-size 32] [--steps 20] [--no-hf]   # one H100/H200
    python benchmarks/t5_throughput.py --tiny --device cpu --steps 2 --eager            # CPU check of the script

The record (``record.py``) has tokens/s (encoder + decoder tokens), TFLOP/s by paratron's T5 FLOPs formula
(paratron/train/t5_step.py) and MFU against the dense bf16 peak, for each side.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paratron.config import ModelConfig  # noqa: E402
from paratron.model.t5 import T5Model  # noqa: E402
from paratron.train.metrics import peak_tflops  # noqa: E402
from paratron.train.t5_step import t5_flops_per_iteration  # noqa: E402

SIZES = {"220m": dict(layers=12, hidden=768, heads=12, kv=64, ffn=3072, enc=512, dec=128, vocab=32128),
         "tiny": dict(layers=2, hidden=64, heads=4, kv=16, ffn=128, enc=64, dec=32, vocab=512)}


def model_config(s: dict) -> ModelConfig:
    return ModelConfig(model="t5", num_layers=s["layers"], decoder_num_layers=s["layers"], hidden_size=s["hidden"],
                       num_attention_heads=s["heads"], kv_channels=s["kv"], ffn_hidden_size=s["ffn"],
                       seq_length=s["enc"], encoder_seq_length=s["enc"], decoder_seq_length=s["dec"],
                       position_embedding_type="relative", normalization="RMSNorm", norm_epsilon=1e-6, geglu=True,
                       openai_gelu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                       softmax_scale=1.0, hidden_dropout=0.0, attention_dropout=0.0).resolved()


def batch(s: dict, b: int, device):
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(2, s["vocab"], (b, s["enc"]), generator=g).to(device)
    dec = torch.randint(2, s["vocab"], (b, s["dec"]), generator=g).to(device)
    return enc, dec, dec.roll(-1, 1)


def paratron_step(s: dict, b: int, device, compile_: bool = True):
    model = T5Model(model_config(s), s["vocab"], device=device, dtype=torch.bfloat16)
    for layer in [*model.encoder.layers, *model.decoder.layers] if compile_ else []:  # regional, as --torch-compile
        layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    enc, dec, labels = batch(s, b, device)

    def step():
        loss = model(enc, dec, labels=labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def hf_step(s: dict, b: int, device, compile_: bool = True):
    import transformers
    cfg = transformers.T5Config(vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["kv"], d_ff=s["ffn"],
                                num_layers=s["layers"], num_heads=s["heads"], feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).to(device, torch.bfloat16)
    compiled = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    enc, dec, labels = batch(s, b, device)

    def step():
        loss = compiled(input_ids=enc, decoder_input_ids=dec, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(step, steps: int, device) -> float:
    """Seconds per step after two warm-up steps (compilation)."""
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no torch.compile on either side (a CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--record-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    device, s, b = torch.device(args.device), SIZES["tiny" if args.tiny else "220m"], args.micro_batch_size
    flops = t5_flops_per_iteration(model_config(s), s["vocab"], b)
    peak = peak_tflops(device)
    rows = []
    hf_name = "HF T5" + ("" if args.eager else " + compile")
    for name, make in [("paratron T5Model", paratron_step), *([] if args.no_hf else [(hf_name, hf_step)])]:
        sec = timed(make(s, b, device, not args.eager), args.steps, device)
        tflops = flops / sec / 1e12
        mfu = f"{100 * tflops / peak:.1f} %" if peak else "n/a"
        rows.append(f"| {name} | {sec * 1e3:.1f} | {b * (s['enc'] + s['dec']) / sec:,.0f} | {tflops:.1f} | {mfu} |")
    body = "\n".join(["| model | ms / step | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|", *rows])
    print(body)
    if not args.tiny:
        from record import write_record
        hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        write_record(args.record_dir, "t5_throughput_220m", "T5-220M training throughput beside HF + compile", hw,
                     {"batch": f"{b} x ({s['enc']} encoder + {s['dec']} decoder tokens)"}, body)


if __name__ == "__main__":
    main()
