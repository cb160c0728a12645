"""Timing hooks: every denoiser forward, VAE decode and backward of one adapter, every forward of its text encoders
(prompts not seen before), and every forward of the reward models (a reward scorer's torch modules: Adv-GRPO's
DINOv2 discriminator, CLIP-type scorers), timed and counted."""

from __future__ import annotations

import threading
import time


def _rows(args: tuple, kwargs: dict) -> int:
    for value in (*args, kwargs.get("hidden_states"), kwargs.get("sample")):
        if hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[0])
    return 0


class ModelCallProbe:
    """Times and counts every denoiser forward, VAE decode and autograd backward of one adapter.

    Denoiser: a forward pre-hook / post-hook pair on adapter.denoiser (rows = the batch of its first
    tensor input; grad or not from torch.is_grad_enabled()). VAE: adapter.vae.decode wrapped on the
    instance (it runs on the reward worker threads). Backward: torch.Tensor.backward wrapped while
    installed (every .backward() of the process: the policy's and, in Adv-GRPO, the discriminator's). Text
    encoders and reward models: forward hook pairs on their modules, any thread.
    """

    def __init__(self, adapter, reward_scorers: tuple = ()):
        self.adapter = adapter
        self.reward_scorers = tuple(reward_scorers)
        self.calls: list[tuple[str, float, float, int]] = []  # (kind, start, end, rows)
        self._open: list[tuple[float, int, bool]] = []
        self._lock = threading.Lock()
        self._undo: list = []

    def install(self) -> ModelCallProbe:
        import torch

        den = self.adapter.denoiser

        def pre(module, args, kwargs):
            self._open.append((time.perf_counter(), _rows(args, kwargs), torch.is_grad_enabled()))

        def post(module, args, output):
            if self._open:
                t0, rows, grad = self._open.pop()
                self._add("fwd_grad" if grad else "fwd_nograd", t0, rows)

        handles = [
            den.register_forward_pre_hook(pre, with_kwargs=True),
            den.register_forward_hook(post, always_call=True),
        ]
        self._undo.append(lambda: [h.remove() for h in handles])

        vae = self.adapter.vae
        decode = vae.decode

        def timed_decode(z, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return decode(z, *args, **kwargs)
            finally:
                self._add("decode", t0, int(z.shape[0]))

        vae.decode = timed_decode
        self._undo.append(lambda: vars(vae).pop("decode", None))

        backward = torch.Tensor.backward

        def timed_backward(tensor, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                self._add("backward", t0, 1)

        torch.Tensor.backward = timed_backward
        self._undo.append(lambda: setattr(torch.Tensor, "backward", backward))

        # text encoders (new prompts, main thread) and reward models (the reward worker threads, and Adv-GRPO's
        # discriminator in the update): a stack of open calls per thread and kind
        local = threading.local()

        def hook(module, kind: str) -> None:
            def pre(module, args, kwargs):
                local.__dict__.setdefault(kind, []).append((time.perf_counter(), _rows(args, kwargs)))

            def post(module, args, output):
                stack = local.__dict__.get(kind)
                if stack:
                    t0, rows = stack.pop()
                    self._add(kind, t0, rows)

            handles = [
                module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, always_call=True),
            ]
            self._undo.append(lambda: [h.remove() for h in handles])

        for module in text_encoders(self.adapter):
            hook(module, "text_encoder")
        for module in {id(m): m for s in self.reward_scorers for m in reward_modules(s)}.values():
            hook(module, "reward_model")
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _add(self, kind: str, t0: float, rows: int) -> None:
        with self._lock:
            self.calls.append((kind, t0, time.perf_counter(), rows))

    def summary(self, mark: int, t0: float, t1: float) -> dict[str, float]:
        """Calls since `mark`, inside the wall-clock window [t0, t1]."""
        with self._lock:
            calls = self.calls[mark:]
        out: dict[str, float] = {}
        for kind in ("fwd_nograd", "fwd_grad", "backward", "decode", "text_encoder", "reward_model"):
            mine = [c for c in calls if c[0] == kind]
            out[f"{kind}_s"] = sum(c[2] - c[1] for c in mine)
            out[f"{kind}_calls"] = len(mine)
            out[f"{kind}_rows"] = sum(c[3] for c in mine)
        out["union_fwd_decode_s"] = _union(
            [c[1:3] for c in calls if c[0] in ("fwd_nograd", "fwd_grad", "decode")], t0, t1
        )
        out["union_all_s"] = _union([c[1:3] for c in calls], t0, t1)
        return out


def _union(intervals: list, lo: float, hi: float) -> float:
    """Length of the union of [start, end] intervals clipped to [lo, hi] (calls overlap across threads)."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= max(a, end):
            continue
        total += b - max(a, end)
        end = b
    return total


def text_encoders(adapter) -> list:
    """The pipeline's torch modules other than the denoiser and the VAE: its text encoders (a new prompt's
    embedding is a model call; an adapter without a pipeline has none)."""
    import torch

    pipe = getattr(adapter, "pipe", None)
    skip = (id(adapter.denoiser), id(adapter.vae))
    components = getattr(pipe, "components", {}) if pipe is not None else {}
    return [m for m in components.values() if isinstance(m, torch.nn.Module) and id(m) not in skip]


def reward_modules(scorer, depth: int = 2) -> list:
    """The torch modules a reward scorer runs: its attributes that are modules, or attributes of its attributes
    (e.g. a backbone wrapper's `.model`), outermost first; a module's own submodules are not listed again."""
    import torch

    found, todo = [], [(scorer, 0)]
    while todo:
        obj, level = todo.pop(0)
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            if isinstance(value, torch.nn.Module):
                found.append(value)
            elif level + 1 < depth and hasattr(value, "__dict__") and not isinstance(value, type):
                todo.append((value, level + 1))
    return found
