"""Make `import torchvision` work on a CPU-only torch with PyPI's (CUDA-built) torchvision.

PyPI has no CPU build of torchvision. Its CUDA wheel imports on a CPU torch except that its compiled
ops never load (`torchvision.extension` swallows that), and then `_meta_registrations` fails with
"operator torchvision::nms does not exist". transformers, diffusers, peft, timm and open_clip all
import torchvision when it is installed, so that one failure breaks every model import (and
`accelerate launch`, whose CLI imports timm). This hook wraps the loader of `torchvision.extension`:
once that module has run and its compiled ops did not load, it declares the two op schemas that
`_meta_registrations` needs, so the import goes through. `torchvision.ops.nms` then raises a clear
"Couldn't load custom C++ ops" error; the transforms and models work. Where the compiled ops load (a
matching CUDA or CPU build) it does nothing.

It is installed twice over, both cheap (installing imports nothing; the finder answers only for
`torchvision.extension`):
- by `import flowgrpo` / `pipelines` / `reward_models` (each imports this module first), and
- at every `import torch`, through the `torch.backends` entry point in pyproject.toml (torch calls
  its device-backend plug-ins at the end of its own import, before anything can import torchvision's
  parts). That makes `accelerate launch ... scripts/train_t2i.py ...` work as printed: accelerate's
  CLI imports timm -> torchvision before any flowgrpo code runs. `TORCH_DEVICE_BACKEND_AUTOLOAD=0`
  turns torch's plug-ins off, and with them this second path.
"""

from __future__ import annotations

import sys

_TARGET = "torchvision.extension"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list = []  # the op declarations live as long as their Library objects


def _declare_missing_ops() -> None:
    import torch

    missing = [s for s in _SCHEMAS if not hasattr(torch.ops.torchvision, s.split("(", 1)[0])]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in missing:
        lib.define(schema)
    _LIBRARIES.append(lib)


class _ExtensionLoader:
    """torchvision.extension's own loader, then the op schemas if its compiled ops did not load."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        has_ops = getattr(module, "_has_ops", None)
        if has_ops is not None and not has_ops():
            _declare_missing_ops()

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.loader, name)


class _TorchvisionFinder:
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _ExtensionLoader):
            spec.loader = _ExtensionLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


def install() -> None:
    """Idempotent and cheap (imports nothing). A no-op once torchvision's extension is imported."""
    if _TARGET in sys.modules or any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionFinder())


install()
