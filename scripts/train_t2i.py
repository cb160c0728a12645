"""Train a text-to-image model with any recipe: python scripts/train_t2i.py CONFIG.yaml [key=value ...]

The same as `flowgrpo train-t2i`; runs under `accelerate launch` for several processes.
"""

import sys

from flowgrpo.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-t2i", *sys.argv[1:]]))
