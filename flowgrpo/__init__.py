"""flowgrpo: group-relative RL for flow-matching, diffusion and language models.

Importing the package is light: model libraries (diffusers, transformers) are imported only by the
modules that need them.
"""

__version__ = "0.1.0"

import torchvision_cpu_hook  # noqa: E402,F401  (torchvision on a CPU torch; imports nothing)
