"""The reward-server wire format: JSON only, images as base64 PNG. No pickle.

POST /score request:  {"images": [<base64 PNG>, ...], "prompts": [str, ...] | null,
                       "metadata": {name: [value per image, ...]}}
            or, for video scorers, "videos" in place of "images": one clip per row, either
                       {"format": "png" | "jpeg", "frames": [<base64 image>, ...]} (dependency-free) or
                       {"format": "mp4", "fps": float, "data": <base64 mp4>} (needs PyAV, `av`, on both sides)
            response: {"key": <main key>, "scores": {name: [float | null, ...]}}   (null = NaN)
GET /health response: {"status": "ok", "scorer": <name>, "key": <main key>,
                       "requires_prompts": bool, "metadata_keys": [...]}

Metadata values are JSON values; images inside them (PIL, [3,H,W] or [K,3,H,W] tensors) travel as
{"__png__": <base64 PNG>}. PNG is lossless for the uint8 images every scorer sees, unlike the JPEG
q75 of the published methods' reward servers, which changes what OCR and quality scorers score.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from fractions import Fraction
from typing import Any

import numpy as np

import torch
from PIL import Image

from .images import ImageBatch

PNG_KEY = "__png__"
CLIP_FORMATS = ("png", "jpeg", "mp4")


class WireError(ValueError):
    """A request or response that does not follow the wire format."""


class ImageTooLarge(WireError):
    """An image whose header declares more pixels than the server accepts (answered 413, never decoded)."""


MAX_JSON_DEPTH = 64  # the wire format nests 4 levels; metadata gets room, a 100,000-deep `[[[...` does not


def parse_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads that refuses documents nested deeper than `max_depth` with a WireError (no RecursionError)."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise WireError(f"JSON nested deeper than {max_depth} levels") from None
    stack = [(value, 1)]
    while stack:  # iterative: checking the depth must not recurse either
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    raise WireError(f"JSON nested deeper than {max_depth} levels")
                stack.append((child, depth + 1))
    return value


def encode_png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)  # lossless either way; level 1 is fast
    return base64.b64encode(buf.getvalue()).decode("ascii")


def open_png(data: Any, max_pixels: int | None = None) -> Image.Image:
    """A base64 PNG opened with its header read only (no pixel decoded): ImageTooLarge over `max_pixels` (a
    435 KB PNG can declare 12000 x 12000 pixels). `_load_png` decodes it."""
    if not isinstance(data, str):
        raise WireError(f"an image must be a base64 PNG string, got {type(data).__name__}")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))  # reads the header only
    except (binascii.Error, OSError, Image.DecompressionBombError) as e:
        raise WireError(f"undecodable image: {e}") from None
    if image.format != "PNG":
        raise WireError(f"images must be PNG, got {image.format}")
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(
            f"image of {width} x {height} pixels is over the server's limit of {max_pixels} pixels; send smaller images"
        )
    return image


def _load_png(image: Image.Image) -> Image.Image:
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise WireError(f"undecodable image: {e}") from None
    return image.convert("RGB")


def check_request_pixels(images: list[Image.Image], max_request_pixels: int | None) -> None:
    """ImageTooLarge when opened (not yet decoded) images hold more than `max_request_pixels` in all: the
    decoded memory of one request is bounded, not only that of each image."""
    total = sum(im.size[0] * im.size[1] for im in images)
    if max_request_pixels is not None and total > max_request_pixels:
        raise ImageTooLarge(
            f"{len(images)} images of {total} pixels in all are over the server's limit of {max_request_pixels} "
            "pixels per request; send fewer or smaller images per request"
        )


def decode_pngs(data: Any, max_pixels: int | None = None, max_request_pixels: int | None = None) -> list[Image.Image]:
    """A list of base64 PNGs -> RGB images; every header is checked (per image, then their sum) before any
    image is decoded."""
    if not isinstance(data, list):
        raise WireError(f"'images' must be a list, got {type(data).__name__}")
    opened = [open_png(s, max_pixels) for s in data]
    check_request_pixels(opened, max_request_pixels)
    return [_load_png(im) for im in opened]


def encode_value(value: Any) -> Any:
    """A metadata value -> JSON, with images as {"__png__": ...}."""
    if isinstance(value, Image.Image):
        return {PNG_KEY: encode_png(value.convert("RGB"))}
    if isinstance(value, torch.Tensor):
        if value.ndim == 3 and value.shape[0] == 3 and value.is_floating_point():
            return {PNG_KEY: encode_png(ImageBatch(value[None]).pil()[0])}
        if value.ndim == 4 and value.shape[1] == 3 and value.is_floating_point():
            return [{PNG_KEY: encode_png(im)} for im in ImageBatch(value).pil()]
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise WireError(f"metadata value of type {type(value).__name__} cannot go over the wire")


def encode_request(images: ImageBatch, prompts: list[str] | None, metadata: dict[str, list] | None) -> dict:
    return {
        "images": [encode_png(im) for im in images.pil()],
        "prompts": None if prompts is None else list(prompts),
        "metadata": {k: [encode_value(v) for v in vs] for k, vs in (metadata or {}).items()},
    }


def _open_value(value: Any, max_pixels: int | None, opened: list[Image.Image]) -> Any:
    """A metadata value from JSON with its images only opened (header read), each appended to `opened`."""
    if isinstance(value, dict):
        if set(value) == {PNG_KEY}:
            opened.append(open_png(value[PNG_KEY], max_pixels))
            return opened[-1]
        return {k: _open_value(v, max_pixels, opened) for k, v in value.items()}
    if isinstance(value, list):
        return [_open_value(v, max_pixels, opened) for v in value]
    return value


def _load_value(value: Any) -> Any:
    if isinstance(value, Image.Image):
        return _load_png(value)
    if isinstance(value, dict):
        return {k: _load_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_load_value(v) for v in value]
    return value


def decode_request(
    payload: Any, max_pixels: int | None = None, max_request_pixels: int | None = None
) -> tuple[list[Image.Image], list[str] | None, dict[str, list]]:
    """A /score request -> (images, prompts, metadata). Every image's PNG header (metadata images too) is read
    before any is decoded: ImageTooLarge for one over `max_pixels`, or for more than `max_request_pixels` in all."""
    if not isinstance(payload, dict) or not isinstance(payload.get("images"), list):
        raise WireError("request must be a JSON object with an 'images' list")
    opened: list[Image.Image] = []
    images = [open_png(s, max_pixels) for s in payload["images"]]
    n = len(images)
    prompts = payload.get("prompts")
    if prompts is not None and (
        not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts)
    ):
        raise WireError(f"'prompts' must be null or a list of {n} strings")
    metadata = payload.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise WireError("'metadata' must be an object of lists")
    for k, v in metadata.items():
        if not isinstance(v, list) or len(v) != n:
            raise WireError(f"metadata '{k}' must be a list of {n} values")
    metadata = {k: _open_value(v, max_pixels, opened) for k, v in metadata.items()}
    check_request_pixels(images + opened, max_request_pixels)
    return [_load_png(im) for im in images], prompts, {k: _load_value(v) for k, v in metadata.items()}


def encode_scores(scores: dict[str, torch.Tensor], key: str) -> dict:
    def number(x: float):
        return x if math.isfinite(x) else None  # JSON has no NaN; null means "could not score"

    return {"key": key, "scores": {k: [number(float(x)) for x in v.detach().cpu().tolist()] for k, v in scores.items()}}


def decode_scores(payload: Any, n: int) -> tuple[str, dict[str, torch.Tensor]]:
    """Validate a /score response for n images; null -> NaN."""
    if not isinstance(payload, dict) or not isinstance(payload.get("scores"), dict) or not payload["scores"]:
        raise WireError("response must be a JSON object with a non-empty 'scores' object")
    key = payload.get("key")
    if not isinstance(key, str) or key not in payload["scores"]:
        raise WireError(f"response 'key' {key!r} is not one of its scores {sorted(payload['scores'])}")
    out = {}
    for name, values in payload["scores"].items():
        if not isinstance(values, list) or len(values) != n:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise WireError(f"score '{name}' must be a list of {n} numbers, got {got}")
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            raise WireError(f"score '{name}' holds values that are neither numbers nor null")
        out[name] = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)
    return key, out


# ---- video clips -------------------------------------------------------------------------------------------------


def _require_av(what: str):
    try:
        import av
    except ImportError:
        raise WireError(f"{what} needs PyAV (pip install av); use clip format 'png' or 'jpeg' instead") from None
    return av


def frames_uint8(clip: torch.Tensor) -> np.ndarray:
    """[F, 3, H, W] float in [0, 1] -> [F, H, W, 3] uint8, rounded as ImageBatch rounds."""
    return (clip.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """[F, H, W, 3] uint8 -> H.264 mp4 bytes (yuv420p: lossy, and H, W are padded to even by edge copies)."""
    av = _require_av("mp4 clips")
    h, w = frames.shape[1:3]
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def encode_clip(clip: torch.Tensor, clip_format: str = "png", *, fps: float = 8.0, jpeg_quality: int = 95) -> dict:
    """One clip [F, 3, H, W] float in [0, 1] -> its wire object (see the module docstring)."""
    if clip_format not in CLIP_FORMATS:
        raise ValueError(f"clip_format must be one of {CLIP_FORMATS}, got {clip_format!r}")
    frames = frames_uint8(clip)
    if clip_format == "mp4":
        data = base64.b64encode(encode_mp4(frames, fps)).decode("ascii")
        return {"format": "mp4", "fps": float(fps), "data": data}
    out = []
    for frame in frames:
        buf = io.BytesIO()
        if clip_format == "png":
            Image.fromarray(frame).save(buf, format="PNG", compress_level=1)
        else:
            Image.fromarray(frame).save(buf, format="JPEG", quality=int(jpeg_quality))
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return {"format": clip_format, "frames": out}


def _open_frame(data: Any, clip_format: str, max_pixels: int | None) -> Image.Image:
    if clip_format == "png":
        return open_png(data, max_pixels)
    if not isinstance(data, str):
        raise WireError(f"a frame must be a base64 JPEG string, got {type(data).__name__}")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
    except (binascii.Error, OSError, Image.DecompressionBombError) as e:
        raise WireError(f"undecodable frame: {e}") from None
    if image.format != "JPEG":
        raise WireError(f"frames of a 'jpeg' clip must be JPEG, got {image.format}")
    if max_pixels is not None and image.size[0] * image.size[1] > max_pixels:
        raise ImageTooLarge(f"frame of {image.size[0]} x {image.size[1]} pixels is over the limit of {max_pixels}")
    return image


def _decode_mp4(data: Any, max_pixels: int | None, budget: list[int | None]) -> np.ndarray:
    av = _require_av("an mp4 clip")
    if not isinstance(data, str):
        raise WireError(f"an mp4 clip's 'data' must be a base64 string, got {type(data).__name__}")
    frames = []
    try:
        with av.open(io.BytesIO(base64.b64decode(data, validate=True))) as container:
            stream = container.streams.video[0]
            pixels = stream.codec_context.width * stream.codec_context.height
            if max_pixels is not None and pixels > max_pixels:
                raise ImageTooLarge(f"video frames of {pixels} pixels are over the limit of {max_pixels}")
            for frame in container.decode(stream):
                if budget[0] is not None:  # the request's pixel budget, spent frame by frame
                    budget[0] -= pixels
                    if budget[0] < 0:
                        raise ImageTooLarge("the request's video frames are over the server's pixel limit")
                frames.append(frame.to_ndarray(format="rgb24"))
    except (binascii.Error, IndexError, av.FFmpegError) as e:
        raise WireError(f"undecodable mp4 clip: {e}") from None
    if not frames:
        raise WireError("an mp4 clip without frames")
    return np.stack(frames)


def decode_clips(data: Any, max_pixels: int | None = None, max_request_pixels: int | None = None) -> torch.Tensor:
    """A request's 'videos' list -> clips [B, F, 3, H, W] float in [0, 1]; frame headers (PNG, JPEG) are checked
    against the limits before any frame is decoded (mp4: frame by frame)."""
    if not isinstance(data, list):
        raise WireError(f"'videos' must be a list, got {type(data).__name__}")
    opened: list[list[Image.Image] | None] = []
    for clip in data:
        fmt = clip.get("format") if isinstance(clip, dict) else None
        if fmt not in CLIP_FORMATS:
            raise WireError(f"a clip must be an object with 'format' one of {CLIP_FORMATS}, got {str(clip)[:80]}")
        if fmt == "mp4":
            opened.append(None)
            continue
        if not isinstance(clip.get("frames"), list) or not clip["frames"]:
            raise WireError("a png / jpeg clip needs a non-empty 'frames' list")
        opened.append([_open_frame(f, fmt, max_pixels) for f in clip["frames"]])
    check_request_pixels([im for frames in opened if frames for im in frames], max_request_pixels)
    budget: list[int | None] = [max_request_pixels]
    arrays = []
    for clip, frames in zip(data, opened):
        if frames is None:
            arrays.append(_decode_mp4(clip.get("data"), max_pixels, budget))
        else:
            arrays.append(np.stack([np.asarray(_load_png(im)) for im in frames]))
    if len({a.shape for a in arrays}) > 1:
        raise WireError(f"clips differ in shape {sorted({a.shape for a in arrays})}")
    if not arrays:
        return torch.empty(0, 1, 3, 1, 1)
    return torch.from_numpy(np.stack(arrays)).permute(0, 1, 4, 2, 3).float() / 255.0


def encode_video_request(
    clips: torch.Tensor, prompts: list[str] | None, metadata: dict[str, list] | None, clip_format: str = "png",
    *, fps: float = 8.0, jpeg_quality: int = 95,
) -> dict:  # fmt: skip
    return {
        "videos": [encode_clip(c, clip_format, fps=fps, jpeg_quality=jpeg_quality) for c in clips],
        "prompts": None if prompts is None else list(prompts),
        "metadata": {k: [encode_value(v) for v in vs] for k, vs in (metadata or {}).items()},
    }


def decode_video_request(
    payload: Any, max_pixels: int | None = None, max_request_pixels: int | None = None
) -> tuple[torch.Tensor, list[str] | None, dict[str, list]]:
    """A /score request with 'videos' -> (clips [B, F, 3, H, W], prompts, metadata); metadata as decode_request."""
    if not isinstance(payload, dict) or not isinstance(payload.get("videos"), list):
        raise WireError("request must be a JSON object with a 'videos' list")
    n = len(payload["videos"])
    prompts = payload.get("prompts")
    if prompts is not None and (
        not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts)
    ):
        raise WireError(f"'prompts' must be null or a list of {n} strings")
    metadata = payload.get("metadata") or {}
    if not isinstance(metadata, dict) or any(not isinstance(v, list) or len(v) != n for v in metadata.values()):
        raise WireError(f"'metadata' must be an object of lists of {n} values")
    opened: list[Image.Image] = []
    metadata = {k: _open_value(v, max_pixels, opened) for k, v in metadata.items()}
    check_request_pixels(opened, max_request_pixels)
    clips = decode_clips(payload["videos"], max_pixels, max_request_pixels)
    return clips, prompts, {k: _load_value(v) for k, v in metadata.items()}
