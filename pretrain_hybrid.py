#!/usr/bin/env python
"""Megatron-LM's hybrid-model entry point (Mamba-2, Gated DeltaNet, attention and MLP layers by
--hybrid-layer-pattern), with its flags: `python pretrain_hybrid.py ...` or `torchrun ... pretrain_hybrid.py ...`."""
import sys

from paratron.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main(prog="pretrain_hybrid.py", hybrid=True))
