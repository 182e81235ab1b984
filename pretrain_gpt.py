#!/usr/bin/env python
"""Megatron-LM's entry point, with its flags: `python pretrain_gpt.py ...` or
`torchrun --nproc-per-node N pretrain_gpt.py ...`."""
import sys

from paratron.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main())
