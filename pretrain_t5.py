#!/usr/bin/env python
"""Megatron-LM's T5 entry point, with its flags: `python pretrain_t5.py ...` or
`torchrun --nproc-per-node N pretrain_t5.py ...` (the same as `paratron train --model t5 ...`)."""
import sys

from paratron.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main(model="t5"))
