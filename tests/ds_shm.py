"""Test-only: ZeRO ranks on CPU skip DeepSpeed's shared-memory all-reduce kernel.

DeepSpeed's torch backend JIT-compiles that kernel (csrc/cpu/comm/shm*.cpp, about 45 s of both cores) into a
cache keyed by the venv's path, so every CI clone compiled it again while its ranks waited on the lock. It
serves `inference_all_reduce` only: the training collectives of ZeRO go through torch.distributed (gloo) with or
without it, so what the tests compare does not change.
"""

from __future__ import annotations


def skip_shm_kernel() -> None:
    import importlib

    import torchvision_cpu_hook  # noqa: F401  (before anything that may import torchvision on a CPU torch)

    # the module itself: `import deepspeed.comm.torch as m` binds the attribute deepspeed.comm.torch, which
    # deepspeed.comm's star imports overwrite with PyTorch's own `torch`
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
