#!/usr/bin/env python
"""Megatron-compatible `tools/preprocess_data.py`: JSONL -> PREFIX_KEY_document.bin/.idx.

Same flags as Megatron-LM's tool; see docs/data.md. All the work is in paratron.data.preprocess.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from paratron.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
