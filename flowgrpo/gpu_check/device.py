"""The device: name, dense bf16 peak FLOP/s, library versions, a synchronising timer, peak memory."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import platform
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendors' data sheets, TFLOP/s. The first
# name contained in torch.cuda.get_device_name() wins, so specific names come before general ones.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)
VERSIONED = ("torch", "diffusers", "transformers", "peft", "accelerate", "xformers", "vllm")


def peak_tflops(name: str) -> Optional[float]:
    """Dense bf16 peak of a device by name; None when the name is not in the table (e.g. a CPU)."""
    return next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)


@dataclass
class DeviceInfo:
    device: str  # "cuda" or "cpu"
    name: str
    peak_tflops: Optional[float]
    peak_source: str  # "table", "--peak-tflops" or "unknown"
    date: str
    versions: dict[str, Optional[str]]


def describe(device: str, peak_override: Optional[float] = None) -> DeviceInfo:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = _cpu_name()
    table = peak_tflops(name)
    peak = peak_override if peak_override is not None else table
    source = "--peak-tflops" if peak_override is not None else ("table" if table is not None else "unknown")
    versions = {}
    for pkg in VERSIONED:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    versions["python"] = platform.python_version()
    versions["cuda"] = torch.version.cuda
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return DeviceInfo(device, name, peak, source, date, versions)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(device: str, into: list[float]) -> Iterator[None]:
    """Wall seconds of the block, the device synchronised on both ends, appended to `into`."""
    sync(device)
    t0 = time.perf_counter()
    yield
    sync(device)
    into.append(time.perf_counter() - t0)


def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> Optional[float]:
    """torch.cuda.max_memory_allocated since the last reset; None on CPU (no allocator statistics)."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
