#!/usr/bin/env python
"""Megatron-LM's older name of pretrain_hybrid.py (a hybrid stack; all Mamba-2 layers without a
--hybrid-layer-pattern), with its flags."""
import sys

from paratron.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main(prog="pretrain_mamba.py", hybrid=True))
