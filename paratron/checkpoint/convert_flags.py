"""``paratron convert``'s flags (no torch: its ``--help`` answers at once; the conversions are convert.py's)."""
from __future__ import annotations

import argparse

from .families import FAMILIES, ConversionError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: torch's names


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConversionError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="paratron convert", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Convert paratron checkpoints to and from Hugging Face model directories and\n"
                "Megatron-LM's and torchtitan's training checkpoints.\n\n"
                "  paratron convert --to hf --load CKPT_DIR --output HF_DIR [--family F] [--iteration N]\n"
                "  paratron convert --to megatron --load CKPT_DIR --output MEGATRON_DIR [--iteration N]\n"
                "  paratron convert --to torchtitan --load CKPT_DIR --output DUMP_DIR (--flavor F | --model-args J)\n"
                "  paratron convert --from hf --input HF_DIR --save CKPT_DIR [--tensor-model-parallel-size N]\n"
                "  paratron convert --from megatron --input MEGATRON_DIR --save CKPT_DIR [--iteration N]\n"
                "  paratron convert --from torchtitan --input DUMP_DIR --save CKPT_DIR (--flavor F | --model-args J)"
                " [--seq-length N] [--iteration N]")
    p.add_argument("--to", dest="to", metavar="hf|megatron|torchtitan", help="convert a paratron checkpoint to "
                   "Hugging Face, Megatron-LM or torchtitan (their training checkpoints, optimizer state included)")
    p.add_argument("--from", dest="frm", metavar="hf|megatron|torchtitan",
                   help="convert a Hugging Face model or a Megatron-LM checkpoint to a paratron checkpoint")
    p.add_argument("--load", metavar="CKPT_DIR", help="--to hf: the paratron checkpoint (training's --save directory)")
    p.add_argument("--output", metavar="HF_DIR", help="--to hf: the Hugging Face directory to write")
    p.add_argument("--family", metavar="F", help=f"--to hf: {'|'.join(FAMILIES)} (default: from the model config)")
    p.add_argument("--iteration", metavar="N", type=int,
                   help="--to hf, --from megatron: this iteration instead of the latest")
    p.add_argument("--input", metavar="DIR", help="--from hf: the Hugging Face model directory; --from megatron: "
                   "the Megatron-LM checkpoint directory (its --save)")
    p.add_argument("--save", metavar="CKPT_DIR", help="--from: the paratron checkpoint directory to write")
    p.add_argument("--tensor-model-parallel-size", metavar="N", type=int, default=1,
                   help="--from hf: print the command for a TP=N run and pad the vocabulary as it does "
                   "(default 1); the checkpoint holds whole tensors, which any layout loads")
    p.add_argument("--expert-model-parallel-size", metavar="N", type=int, help="--to megatron: the Megatron run's "
                   "(default the paratron run's; above 1 its experts have their own optimizer)")
    p.add_argument("--plain-optimizer", action="store_true", help="--to megatron: for a Megatron run without "
                   "--use-distributed-optimizer (its plain optimizer's layout)")
    p.add_argument("--flavor", metavar="F", help="--from/--to torchtitan: [NAME:]FLAVOR (8B, qwen3:0.6B)")
    p.add_argument("--model-args", metavar="JSON", help="--from/--to torchtitan: a custom flavor's model args")
    p.add_argument("--seq-length", metavar="N", type=int, help="--from torchtitan: its training.seq_len")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep their dtype)")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p
