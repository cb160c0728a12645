"""Validate the GPU path in one command (about 8 minutes on one H100) and write docs/gpu_validation.md.

HF_HUB_OFFLINE=1 python scripts/gpu_check.py            # real-size random models on CUDA
python scripts/gpu_check.py --tiny --out /tmp/gpu.md    # the same code with tiny models on CPU
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flowgrpo  # noqa: E402,F401  (torchvision import hook before diffusers / transformers)
from flowgrpo.gpu_check.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
