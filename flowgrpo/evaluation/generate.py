"""Generate evaluation images with a model adapter: deterministic ODE sampling (plan `ode_only`),
decoded by the adapter and saved as PNG into `<run>/images/`.

The folder also gets `images/prompts.jsonl` (file, prompt, index, metadata), so it can be scored
again later as an image folder. Images are scored from the saved PNGs, so re-scoring that folder
gives the same numbers.

Image editing (flux_kontext, qwenimage_edit, qwenimage_edit_plus): the prompt rows name input images (see
sources.py), read with the trainer's loader and brought to height x width; the rows reach the adapter as
`EditPrompt`s. Each row's source images, as the model saw them, are saved beside the edits
(`<row>_src<k>.png`) and listed in the metadata "images", so scorers get metadata["source_images"] and the
report shows source and edit side by side. A text-to-image family given image rows, or an editing family
given plain prompts, is a one-line error before any model loads.

A video family (wan) decodes clips: each is saved as `<row>_<k>.mp4` (H.264 through PyAV; an animated `.webp`
without it, flowgrpo.video_io) at `fps` frames per second, and scored from that file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tqdm.auto import tqdm

from ..config import ConfigError
from ..t2i.edit_data import SOURCE_KEY, ImageSpec, check_family
from ..video_io import write_video
from .config import GenerateInput
from .sources import SOURCES, EvaluationError, Sample, assign_indices, prompt_set

IMAGES_DIR = "images"
PROMPTS_NAME = "prompts.jsonl"


def build_model(cfg: GenerateInput):
    """The adapter of `cfg.model`, with the LoRA of `cfg.lora` loaded (and active) when given."""
    from pipelines.adapters import build_adapter
    from reward_models.placement import resolve_device, resolve_dtype

    kw = dict(cfg.model_options, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    adapter = build_adapter(cfg.model, pretrained=cfg.pretrained, tiny=cfg.tiny, **kw)
    if cfg.lora is not None:
        adapter.load_lora(cfg.lora)
        for p in adapter.lora_parameters():
            p.requires_grad_(False)
    return adapter


def batch_seed(seed: int, first_prompt: int) -> int:
    """Seed of the noise generator for the batch whose first prompt has this index."""
    return (seed * 1_000_003 + first_prompt) % (2**63)


def _clear_previous(images_dir: Path) -> None:
    """Remove the images a previous generation listed in its prompts.jsonl (and nothing else)."""
    listing = images_dir / PROMPTS_NAME
    if not listing.is_file():
        return
    for line in listing.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        sources = (row.get("metadata") or {}).get(SOURCES)
        for name in [row.get("file"), *(sources if isinstance(sources, list) else [])]:
            if isinstance(name, str) and Path(name).name == name:  # only plain names inside the folder
                (images_dir / name).unlink(missing_ok=True)
    listing.unlink()


def generate_images(cfg: GenerateInput, run_dir: str | Path, progress: bool = True, adapter=None) -> list[Sample]:
    """Generate `images_per_prompt` images for every prompt of `cfg.prompts` into `run_dir/images`.

    `adapter`: an already built adapter to use instead of building one from `cfg` (tests, notebooks).
    """
    import torch

    from pipelines.plans import build_plan
    from pipelines.sampler import Sampler, SamplerConfig
    from reward_models.images import to_uint8_hwc
    from PIL import Image

    rows = prompt_set(cfg.prompts, cfg.max_prompts, ImageSpec(cfg.height, cfg.width, cfg.image_resize))
    try:
        check_family([r.prompt for r in rows], cfg.model, f"input.generate.prompts ({cfg.prompts})")
    except ConfigError as err:
        raise EvaluationError(str(err)) from None
    run_dir = Path(run_dir)
    images_dir = run_dir / IMAGES_DIR
    images_dir.mkdir(parents=True, exist_ok=True)
    _clear_previous(images_dir)
    if adapter is None:
        adapter = build_model(cfg)
    elif cfg.lora is not None:
        raise EvaluationError("pass either an adapter or generate.lora, not both")
    try:
        adapter.check_resolution(cfg.height, cfg.width)
    except ValueError as err:
        raise EvaluationError(f"input.generate: {err}") from None
    sampler = Sampler(
        SamplerConfig(
            num_steps=cfg.num_steps,
            guidance_scale=cfg.guidance_scale,
            cfg_mode=cfg.cfg_mode,
            shift=cfg.shift,
            height=cfg.height,
            width=cfg.width,
        )
    )
    plan = build_plan("ode_only", cfg.num_steps, solver=cfg.solver)
    k = cfg.images_per_prompt
    # (prompt, index) stays unique when a prompt is listed twice: its images are numbered on.
    expanded = [row for row in rows for _ in range(k)]
    # (EditPrompts of one text and other images are distinct prompts, but a run matches by the plain text)
    indices = assign_indices([dataclasses.replace(r, prompt=str(r.prompt)) for r in expanded], cfg.prompts)
    width = max(5, len(str(len(rows) - 1)))
    samples: list[Sample] = []
    bar = tqdm(total=len(rows) * k, desc="generate", unit="img", disable=not progress)
    for start in range(0, len(rows), cfg.batch_size):
        chunk = rows[start : start + cfg.batch_size]
        generator = torch.Generator().manual_seed(batch_seed(cfg.seed, start))
        saved = {p: _save_sources(row, images_dir, f"{p:0{width}d}") for p, row in enumerate(chunk, start)}
        tree = sampler.run(adapter, [r.prompt for r in chunk], plan, k, generator)
        latents = tree.leaf_latents().flatten(0, 1)  # [P*k, C, h, w], prompt-major
        pixels: list = []
        with torch.no_grad():
            each = max(1, cfg.batch_size)
            row_prompts = [r.prompt for r in chunk for _ in range(k)]
            for s, part in enumerate(latents.split(each)):
                # images [B, 3, H, W] or a video family's clips [B, F, 3, H, W]
                decoded = adapter.decode(part, row_prompts[s * each : (s + 1) * each])
                pixels.append(list(decoded) if decoded.ndim == 5 else to_uint8_hwc(decoded))
        for j, array in enumerate(a for block in pixels for a in block):
            p, g = start + j // k, j % k
            name = f"{p:0{width}d}_{g:02d}.png"
            if isinstance(array, torch.Tensor):  # a clip [F, 3, H, W]: .mp4, or .webp without PyAV
                name = write_video(array, images_dir / name, cfg.fps).name
            else:
                Image.fromarray(array).save(images_dir / name)
            row = expanded[p * k + g]
            meta = {key: v for key, v in row.metadata.items() if key != SOURCE_KEY}
            if saved[p]:
                meta[SOURCES] = saved[p]
            samples.append(Sample(f"{IMAGES_DIR}/{name}", str(row.prompt), indices[p * k + g], meta))
        bar.update(len(chunk) * k)
    bar.close()
    with open(images_dir / PROMPTS_NAME, "w", encoding="utf-8") as f:
        for s in samples:
            row = {"file": Path(s.file).name, "prompt": s.prompt, "index": s.index}
            if s.metadata:
                row["metadata"] = dict(s.metadata)
                if SOURCES in s.metadata:  # the listing's paths are relative to the listing's folder
                    row["metadata"][SOURCES] = [Path(f).name for f in s.metadata[SOURCES]]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return samples


def _save_sources(row, images_dir: Path, stem: str) -> list[str]:
    """An edit row's source images (as the model saw them) as PNGs; their paths relative to the run folder."""
    from PIL import Image

    out = []
    for n, image in enumerate(getattr(row.prompt, "images", ())):
        name = f"{stem}_src{n}.png"
        Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).save(images_dir / name)
        out.append(f"{IMAGES_DIR}/{name}")
    return out
