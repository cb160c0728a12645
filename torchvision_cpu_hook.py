"""Make `import torchvision` work on a CPU-only torch with PyPI's (CUDA-built) torchvision.

PyPI has no CPU build of torchvision. Its CUDA wheel imports on a CPU torch except that its compiled
ops never load, and then `_meta_registrations` fails with "operator torchvision::nms does not exist".
transformers, diffusers, peft and open_clip all import torchvision when it is installed, so that one
failure breaks every model import. This hook runs on the first `import torchvision`: it tries the real
import, and only on that exact failure it declares the two op schemas (so the registration succeeds)
and imports again. `torchvision.ops.nms` then raises a clear "Couldn't load custom C++ ops" error; the
transforms and models work. Installing the hook imports nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list = []  # the op declarations live as long as their Library objects


def _drop_half_imported() -> None:
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


def _import_torchvision():
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        import torch

        _drop_half_imported()
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            lib.define(schema)
        _LIBRARIES.append(lib)
        return importlib.import_module("torchvision")


class _Existing(importlib.abc.Loader):
    """Hands the import system the module the hook already imported."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once; the nested import below takes the normal path
        # not installed (it is only in the `clip` extra): say so the way every finder does, with None,
        # so `importlib.util.find_spec("torchvision")` (transformers' availability check) gives None
        if importlib.util.find_spec(name) is None:
            return None
        module = _import_torchvision()
        return importlib.machinery.ModuleSpec(
            name, _Existing(module), origin=getattr(module, "__file__", None), is_package=True
        )


def install() -> None:
    """Idempotent. A no-op when torchvision is already imported."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionFinder())


install()
