"""Adv-GRPO (the `adversarial` method wrapper): a trained reward learns reference images (real) from rollouts (fake).

`AdversarialAlternation` wraps the configured method and builds one `Discriminator` around the scorer named by `adversarial.reward` (it must be
trainable: `hinge_loss(real, fake) -> HingeLoss(loss, metrics)`, `trainable_parameters()` and
`state_tensors()` / `load_state_tensors()`, e.g. `dino_discriminator`). On iterations with (it + 1) % d_times != 0 the discriminator trains (one Adam
step on the hinge loss, the iteration's rollout images as fakes, as many references drawn at
random as reals) and the policy does not; on the others the policy trains on the discriminator's
reward. References: every PNG / JPEG of a folder, resized to the rollout size, or synthetic ones
("bright": near-white noise, "dark": near-black noise) for tests and demos. They are kept as uint8
on the CPU. Under data parallelism the head gradients are averaged over ranks before the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import torch

from ..config import ConfigError
from .config import AdversarialConfig
from .credit import assign_credit
from .methods import WRAPPERS, ImageContext, ImageMethod, ScoredRollout

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SYNTHETIC_REFERENCES = 64  # images made by reference_generator
_SEED_SALT = 0x5EED_AD5  # keeps the reference draws apart from other generators seeded with cfg.seed


def load_reference_folder(folder: str | Path, size: tuple[int, int]) -> torch.Tensor:
    """Every .png / .jpg / .jpeg under `folder` (sorted, recursive) -> uint8 [R, 3, H, W], bicubic."""
    from PIL import Image

    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"adversarial.references: '{folder}' is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"adversarial.references: no PNG / JPEG images under '{folder}'")
    h, w = size
    out = torch.empty(len(files), 3, h, w, dtype=torch.uint8)
    for i, f in enumerate(files):
        with Image.open(f) as im:
            rgb = im.convert("RGB")
            if rgb.size != (w, h):
                rgb = rgb.resize((w, h), Image.BICUBIC)
            out[i] = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
    return out


def synthetic_references(
    kind: str, size: tuple[int, int], generator: torch.Generator, n: int = SYNTHETIC_REFERENCES
) -> torch.Tensor:
    """'bright': pixels uniform in [0.85, 1]; 'dark': uniform in [0, 0.15]; uint8 [n, 3, H, W]."""
    if kind not in ("bright", "dark"):
        raise ConfigError(f"adversarial.reference_generator must be 'bright' or 'dark', got {kind!r}")
    noise = torch.rand(n, 3, *size, generator=generator) * 0.15
    x = 1.0 - noise if kind == "bright" else noise
    return (x * 255).round().to(torch.uint8)


class Discriminator:
    """A trainable reward, its Adam optimizer, the reference images and the D / G schedule."""

    def __init__(self, scorer, cfg: AdversarialConfig, size: tuple[int, int], seed: int):
        missing = [
            m
            for m in ("hinge_loss", "trainable_parameters", "state_tensors", "load_state_tensors")
            if not callable(getattr(scorer, m, None))
        ]
        if missing:
            raise ConfigError(
                f"adversarial.reward '{cfg.reward}' is the scorer '{getattr(scorer, 'name', scorer)}', "
                f"which cannot be trained (no {missing}); use e.g. 'dino_discriminator'"
            )
        self.scorer, self.cfg = scorer, cfg
        self.size = (int(size[0]), int(size[1]))
        self.generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + _SEED_SALT) % 2**63)
        if cfg.references is not None:
            self.references = load_reference_folder(cfg.references, self.size)
        elif cfg.reference_generator is not None:
            self.references = synthetic_references(cfg.reference_generator, self.size, self.generator)
        else:
            raise ConfigError("adversarial: set `references: <folder>` or `reference_generator`")
        self.params = list(scorer.trainable_parameters())
        if not self.params:
            raise ConfigError(f"adversarial.reward '{cfg.reward}' has no trainable parameters")
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, betas=tuple(cfg.betas))
        self.updates = 0
        from ..distributed import Distributed

        self.dist = Distributed.from_environment()

    def trains_at(self, iteration: int) -> bool:
        """True where the discriminator trains instead of the policy: (iteration + 1) % d_times != 0."""
        return (int(iteration) + 1) % self.cfg.d_times != 0

    def sample_references(self, n: int) -> torch.Tensor:
        """n reference images, float [n, 3, H, W] in [0, 1]: without replacement while there are
        enough, then with."""
        r = self.references.shape[0]
        if n <= r:
            idx = torch.randperm(r, generator=self.generator)[:n]
        else:
            idx = torch.randint(0, r, (n,), generator=self.generator)
        return self.references[idx].float() / 255.0

    def update(self, images: torch.Tensor, batch_prompts: Any, group_size: int) -> dict[str, float]:
        """One Adam step of the hinge loss: references real, `images` ([N, 3, H, W] in [0, 1], this
        rank's rollout) fake. batch_prompts / group_size are accepted for the trainer's interface;
        the references are shared by all prompts."""
        if images is None or images.ndim != 4 or images.shape[0] == 0:
            raise ValueError("Discriminator.update needs the rollout images [N, 3, H, W]")
        if group_size and images.shape[0] % int(group_size):
            raise ValueError(f"{images.shape[0]} images are not whole groups of {group_size}")
        real = self.sample_references(images.shape[0]).to(images.device)
        hinge = self.scorer.hinge_loss(real, images.detach())
        self.optimizer.zero_grad(set_to_none=True)
        hinge.loss.backward()
        if self.dist.active:
            self.dist.all_reduce_grads(self.params)  # summed over ranks: average them
            for p in self.params:
                p.grad.div_(self.dist.world_size)
        grad_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.detach().float().norm() for p in self.params if p.grad is not None])
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        out = {f"adversarial/{k}": float(v) for k, v in hinge.metrics.items()}
        out.update(
            {
                "adversarial/d_update": 1,
                "adversarial/d_steps": self.updates,
                "adversarial/d_grad_norm": float(grad_norm),
            }
        )
        return out

    # --- checkpoint (the optimizer is saved by the trainer through .optimizer) ----------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The scorer's trainable state ('scorer.<name>': head weights, patch generator) plus the
        reference generator and the update count."""
        out = {f"scorer.{k}": v for k, v in self.scorer.state_tensors().items()}
        out["reference_generator"] = self.generator.get_state().clone()
        out["updates"] = torch.tensor(self.updates, dtype=torch.int64)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        scorer = {k[len("scorer.") :]: v for k, v in tensors.items() if k.startswith("scorer.")}
        self.scorer.load_state_tensors(scorer)
        self.generator.set_state(tensors["reference_generator"].cpu().to(torch.uint8))
        self.updates = int(tensors["updates"])


@WRAPPERS.register("adversarial")
class AdversarialAlternation(ImageMethod):
    """On discriminator iterations the discriminator trains on the rollout images and the policy does not
    (its credit metrics are still logged); on the others the wrapped method updates the policy."""

    needs_images = True

    def __init__(self, ctx: ImageContext, inner: ImageMethod) -> None:
        super().__init__(ctx)
        self.inner = inner
        cfg = ctx.cfg
        assert ctx.scorer is not None, "the adversarial wrapper trains a configured scorer"
        self.discriminator = Discriminator(
            ctx.scorer(cfg.adversarial.reward),
            cfg.adversarial,
            (cfg.sampler.height, cfg.sampler.width),
            cfg.seed,
        )

    def rollout_policy(self) -> ContextManager[Any]:
        return self.inner.rollout_policy()

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        if self.discriminator.trains_at(ctx.iteration):
            record.update(self.discriminator.update(rollout.images, rollout.batch_prompts, cfg.group_size))
            record["adversarial/policy_update"] = 0
            if ctx.ema is not None:
                ctx.ema.idle_iteration()
            record.update(
                assign_credit(
                    rollout.global_tree, rollout.leaf_values, rollout.probe_values, rollout.preferences, cfg,
                    ctx.iteration, rollout.prompt_ids, rollout.prompt_state,
                ).metrics
            )  # fmt: skip
        else:
            self.inner.update(rollout, record)
            record["adversarial/policy_update"] = 1

    def checkpoint_parts(self, parts: Any) -> None:
        self.inner.checkpoint_parts(parts)
        parts.tensors["discriminator"] = self.discriminator.state_tensors()
        parts.optimizers["discriminator"] = self.discriminator.optimizer

    def restore(self, ckpt: Any) -> None:
        self.inner.restore(ckpt)
        self.discriminator.load_state_tensors(ckpt.tensors["discriminator"])
