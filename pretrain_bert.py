#!/usr/bin/env python
"""Megatron-LM's BERT entry point, with its flags: `python pretrain_bert.py ...` or
`torchrun --nproc-per-node N pretrain_bert.py ...` (the same as `paratron train --model bert ...`)."""
import sys

from paratron.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main(model="bert"))
