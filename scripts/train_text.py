#!/usr/bin/env python
"""Train a causal LM with GRPO-family losses: `python scripts/train_text.py CONFIG.yaml [key=value ...]`.

The same as `flowgrpo train-text CONFIG.yaml [key=value ...]`.
"""

import sys

from flowgrpo.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-text", *sys.argv[1:]]))
