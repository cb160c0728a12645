"""Image editing: a prompt that carries its input image(s), and what an editing adapter adds to the contract.

`EditPrompt` is a `str` (the instruction) with `images`: uint8 [3, H, W] CPU tensors, the source image(s) of the
edit. Because it is a string, it travels through the sampler, the trainer and the scorers unchanged; an editing
adapter reads its images in `encode_prompts`. Two rows with the same instruction and different images are
different prompts (equal only with the same pixels; an EditPrompt equals its text as a plain str).

`EditAdapter` (a mixin before the family's text-to-image adapter) encodes, once per (instruction, images) and
not once per step or group member:
- the text rows (a family whose text encoder sees the images, Qwen-Image-Edit's VL encoder, encodes the pair;
  the negative prompt too, as its pipeline does), cached like the text-to-image families' rows;
- the reference latents: each source image through the VAE (the latent distribution's mode, scaled as the
  pipeline does), packed into tokens, cached by the images' digest.
They reach `_forward` in `EditEmbeds.reference` (tokens, zero-padded per batch) and `reference_shapes` (each
reference image's token grid). The denoiser sees [generated tokens; reference tokens]; only the generated tokens'
output is returned, so the velocity of the generated image alone is the action, and the reference latents are
constants (no gradient reaches them, nothing is ever trained on them).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from .embeds import PromptEmbeds, _pad, real_tokens, stack_rows


class EditPrompt(str):
    """An instruction with its source image(s): uint8 [3, H, W] tensors (CPU)."""

    images: tuple[Tensor, ...]
    image_key: str

    def __new__(cls, text: str, images: Sequence[Tensor]) -> "EditPrompt":
        obj = super().__new__(cls, text)
        checked = []
        for i, im in enumerate(images):
            if not isinstance(im, Tensor) or im.dtype != torch.uint8 or im.dim() != 3 or im.shape[0] != 3:
                got = f"{im.dtype} {tuple(im.shape)}" if isinstance(im, Tensor) else type(im).__name__
                raise TypeError(f"EditPrompt images must be uint8 [3, H, W] tensors; image {i} is {got}")
            checked.append(im.detach().cpu().contiguous())
        obj.images = tuple(checked)
        digest = hashlib.sha1()
        for im in obj.images:
            digest.update(repr(tuple(im.shape)).encode())
            digest.update(im.numpy().tobytes())
        obj.image_key = digest.hexdigest()
        return obj

    def __eq__(self, other: object) -> bool:
        """Equal to its text as a plain str (code that compares or looks up prompt texts keeps working); two
        EditPrompts are equal only with the same images. The hash is the text's."""
        if not isinstance(other, str):
            return NotImplemented
        return str.__eq__(self, other) and (not isinstance(other, EditPrompt) or other.image_key == self.image_key)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__

    def __reduce__(self) -> tuple:
        return (EditPrompt, (str(self), self.images))

    def __repr__(self) -> str:
        return f"EditPrompt({str(self)!r}, {len(self.images)} image(s))"


@dataclasses.dataclass
class EditEmbeds(PromptEmbeds):
    """PromptEmbeds + the rows' reference-image tokens: `reference` [B, L, D] (zero-padded to the batch's longest),
    `reference_shapes` long [B, K, 2]: the (h, w) token grid of each reference image, (0, 0) where a row has fewer."""

    reference: Tensor | None = None
    reference_shapes: Tensor | None = None

    def _map(self, fn) -> "EditEmbeds":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return EditEmbeds(**{k: None if t is None else fn(t) for k, t in values.items()})

    def _refs(self, n: int = 1) -> dict[str, Tensor | None]:
        if n == 1:
            return {"reference": self.reference, "reference_shapes": self.reference_shapes}
        return {
            "reference": torch.cat([self.reference] * n),
            "reference_shapes": torch.cat([self.reference_shapes] * n),
        }

    def conditional(self) -> dict[str, Tensor | None]:
        return {**super().conditional(), **self._refs()}

    def unconditional(self) -> dict[str, Tensor | None]:
        return {**super().unconditional(), **self._refs()}

    def cfg_pair(self) -> dict[str, Tensor | None]:
        return {**super().cfg_pair(), **self._refs(2)}


def reference_layout(shapes: Tensor) -> tuple[tuple[int, int], ...]:
    """One row's reference_shapes [K, 2] -> the (h, w) token grids of its images (padding dropped)."""
    return tuple((int(h), int(w)) for h, w in shapes.tolist() if h > 0)


def to_pil(image: Tensor) -> Any:
    """uint8 [3, H, W] -> a PIL RGB image."""
    from PIL import Image

    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def to_vae_input(image: Tensor) -> Tensor:
    """uint8 [3, H, W] -> float32 [1, 3, H, W] in [-1, 1], with diffusers' VaeImageProcessor arithmetic (/255, 2x - 1)."""
    return (image.float() / 255.0)[None] * 2.0 - 1.0


class EditAdapter:
    """Mixin (before the family's adapter) for image-editing families. See the module docstring.

    Families set `text_sees_images` and `max_references`, and implement `_encode_edit_text(text, images)` (one
    row dict as `_encode` gives), `_encode_reference(image) -> packed tokens [1, L, D], (h, w) token grid` and a
    `_forward` that reads text["reference"] / text["reference_shapes"] (`_per_layout` runs rows of different
    reference layouts in separate forwards)."""

    text_sees_images: ClassVar[bool] = False  # True: the text rows (and the negative's) depend on the images
    max_references: ClassVar[int | None] = 1  # input images per prompt the family takes (None: any number)

    def __init__(self, pipe: Any, **kw: Any):
        super().__init__(pipe, **kw)  # type: ignore[call-arg]
        self._references: OrderedDict[str, tuple[Tensor, Tensor]] = OrderedDict()

    def to(self, device: Any) -> Any:
        self._references.clear()
        return super().to(device)  # type: ignore[misc]

    def _check(self, prompts: Sequence[str]) -> None:
        for p in prompts:
            if not isinstance(p, EditPrompt) or not p.images:
                raise ValueError(
                    f"{self.family} edits images: prompt {str(p)[:60]!r} names no input image (a data row needs "  # type: ignore[attr-defined]
                    "'images': [paths])"
                )
            if self.max_references is not None and len(p.images) > self.max_references:
                raise ValueError(
                    f"{self.family} takes {self.max_references} input image(s) per prompt; "  # type: ignore[attr-defined]
                    f"prompt {str(p)[:60]!r} names {len(p.images)}"
                )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], negative_prompt: str = "") -> EditEmbeds:
        """Text rows and reference tokens of each (instruction, images), encoded once each (cached)."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, not a single string")
        self._check(prompts)
        edits: list[EditPrompt] = list(prompts)  # type: ignore[arg-type]
        cond_keys = [self._text_key(str(p), p) for p in edits]
        uncond_keys = [self._text_key(negative_prompt, p) for p in edits]
        stacked_key = (tuple(cond_keys), tuple(uncond_keys), tuple(p.image_key for p in edits))
        cache, stacked = self._cache, self._stacked  # type: ignore[attr-defined]
        wanted = list(dict.fromkeys([*cond_keys, *uncond_keys]))
        if all(k in cache for k in wanted) and stacked_key in stacked:
            for k in wanted:
                cache.move_to_end(k)
            return stacked[stacked_key]
        stacked.clear()
        texts = {**{k: (str(p), p) for k, p in zip(cond_keys, edits)},
                 **{k: (negative_prompt, p) for k, p in zip(uncond_keys, edits)}}  # fmt: skip
        for k in wanted:
            if k not in cache:
                text, p = texts[k]
                cache[k] = real_tokens(self._encode_edit_text(text, p.images if self.text_sees_images else ()), 0)
            cache.move_to_end(k)
        refs = [self._reference(p) for p in edits]
        cond = stack_rows([cache[k] for k in cond_keys])
        uncond = stack_rows([cache[k] for k in uncond_keys])
        limit = max(self.prompt_cache_size, len(wanted))  # type: ignore[attr-defined]
        while len(cache) > limit:
            cache.popitem(last=False)
        while len(self._references) > max(self.prompt_cache_size, len(edits)):  # type: ignore[attr-defined]
            self._references.popitem(last=False)
        n_ref = max(t.shape[1] for t, _ in refs)
        k_ref = max(s.shape[0] for _, s in refs)
        embeds = EditEmbeds.from_rows(
            cond,
            uncond,
            reference=torch.cat([_pad(t, n_ref) for t, _ in refs]),
            reference_shapes=torch.stack([torch.nn.functional.pad(s, (0, 0, 0, k_ref - s.shape[0])) for _, s in refs]),
        )
        if not torch.is_inference_mode_enabled():
            stacked[stacked_key] = embeds
        return embeds

    def _text_key(self, text: str, prompt: EditPrompt) -> tuple[str, str]:
        return (text, prompt.image_key if self.text_sees_images else "")

    def _reference(self, prompt: EditPrompt) -> tuple[Tensor, Tensor]:
        """(packed tokens [1, L, D] of every source image in order, their token grids long [K, 2]), cached."""
        key = prompt.image_key
        if key not in self._references:
            parts = [self._encode_reference(im) for im in prompt.images]
            tokens = torch.cat([t for t, _ in parts], dim=1)
            shapes = torch.tensor([hw for _, hw in parts], dtype=torch.long, device=tokens.device)
            self._references[key] = (tokens, shapes)
        self._references.move_to_end(key)
        return self._references[key]

    def _encode_edit_text(self, text: str, images: tuple[Tensor, ...]) -> dict[str, Tensor]:
        raise NotImplementedError

    def _encode_reference(self, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
        raise NotImplementedError

    def _per_layout(
        self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], run: Callable[..., Tensor]
    ) -> Tensor:
        """`run(x, sigma, text, layout)` on rows grouped by their reference layout (one call when all agree),
        with `text["reference"]` cut to the group's tokens; outputs back in row order."""
        shapes = text["reference_shapes"]
        assert shapes is not None and text["reference"] is not None
        flat = shapes.flatten(1)
        if flat.shape[0] == 1 or bool((flat == flat[:1]).all()):
            layout = reference_layout(shapes[0])
            return run(x, sigma, _cut(text, slice(None), layout), layout)
        groups, inverse = torch.unique(flat, dim=0, return_inverse=True)
        outs, order = [], []
        for g in range(groups.shape[0]):
            rows = (inverse == g).nonzero().flatten()
            layout = reference_layout(groups[g].view(-1, 2))
            outs.append(run(x[rows], sigma[rows], _cut(text, rows, layout), layout))
            order.append(rows)
        return torch.cat(outs)[torch.argsort(torch.cat(order))]


def _cut(text: dict[str, Tensor | None], rows: Any, layout: tuple[tuple[int, int], ...]) -> dict[str, Tensor | None]:
    n = sum(h * w for h, w in layout)
    out = {k: None if v is None else v[rows] for k, v in text.items()}
    out["reference"] = out["reference"][:, :n]  # type: ignore[index]
    return out
