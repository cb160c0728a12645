#!/usr/bin/env python
"""Score images with reward models and write a report: `python scripts/evaluate.py [--config FILE] [key=value ...]`.

    python scripts/evaluate.py --images samples/ --scorers brightness,colorfulness -o outputs/eval/samples
    python scripts/evaluate.py --config eval.yaml --compare outputs/eval/base

See flowgrpo/evaluation/ for the config keys and file formats.
"""

import sys

from flowgrpo.evaluation import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
