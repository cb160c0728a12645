"""Adv-GRPO discriminator: schedule, learning bright references against dark rollouts, state, references."""

import copy

import pytest
import torch
from PIL import Image

from flowgrpo.config import ConfigError
from flowgrpo.t2i.adversarial import Discriminator, load_reference_folder, synthetic_references
from flowgrpo.t2i.config import AdversarialConfig
from flowgrpo.t2i.data import PromptSet
from reward_models import build_scorer
from reward_models.adversarial import HingeLoss

SIZE = (16, 16)
G = 4


def make(lr=1e-2, seed=0, head_seed=0, **cfg):
    scorer = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=8, seed=head_seed)
    settings = dict(enabled=True, reward="dino_discriminator", reference_generator="bright", lr=lr)
    return Discriminator(scorer, AdversarialConfig(**{**settings, **cfg}), SIZE, seed)


def noisy(n, low, seed):
    g = torch.Generator().manual_seed(seed)
    return low + 0.15 * torch.rand(n, 3, *SIZE, generator=g)


PROMPTS = PromptSet(["a cat", "a dog"])


class MeanColourScorer(torch.nn.Module):
    """A stand-in trainable scorer: a linear head on the mean colour, no DINOv2 (a fast schedule test)."""

    name = "mean_colour"

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 1)

    def trainable_parameters(self):
        return list(self.head.parameters())

    def hinge_loss(self, real, fake):
        h_real, h_fake = self.head(real.mean((2, 3))), self.head(fake.mean((2, 3)))
        loss = 0.5 * (torch.relu(1 - h_real).mean() + torch.relu(1 + h_fake).mean())
        return HingeLoss(loss, {"d_loss": float(loss.detach())})

    def state_tensors(self):
        return dict(self.head.state_dict())

    def load_state_tensors(self, tensors):
        self.head.load_state_dict(tensors)


def test_trains_at_schedule_and_any_trainable_scorer():
    def stub(d_times):
        cfg = AdversarialConfig(enabled=True, reward="m", reference_generator="bright", d_times=d_times)
        return Discriminator(MeanColourScorer(), cfg, SIZE, 0)

    d = stub(10)
    assert [it for it in range(30) if not d.trains_at(it)] == [9, 19, 29]
    metrics = d.update(noisy(G, 0.0, seed=0), PROMPTS, G)
    assert metrics["adversarial/d_update"] == 1 and metrics["adversarial/d_loss"] > 0
    d3 = stub(3)
    assert [d3.trains_at(it) for it in range(6)] == [True, True, False, True, True, False]


def test_bright_references_beat_dark_rollouts_after_a_few_updates():
    d = make()
    unseen = torch.cat([noisy(8, 0.85, seed=10), noisy(8, 0.0, seed=11)])  # 8 bright, then 8 dark

    def gap():
        r = d.scorer(unseen)["dino_discriminator"]
        return (r[:8].mean() - r[8:].mean()).item()

    gap0 = gap()
    losses = []
    for step in range(4):
        metrics = d.update(noisy(2 * G, 0.0, seed=step), PROMPTS, G)
        losses.append(metrics["adversarial/d_loss"])
    assert metrics["adversarial/d_update"] == 1 and metrics["adversarial/d_steps"] == 4
    assert {"adversarial/real_score", "adversarial/fake_score", "adversarial/accuracy"} <= set(metrics)
    assert metrics["adversarial/real_score"] > metrics["adversarial/fake_score"]
    assert losses[-1] < losses[0]
    gap1 = gap()
    assert gap1 > 0 and gap1 > gap0 + 0.1
    with pytest.raises(ValueError, match="whole groups"):
        d.update(noisy(G + 1, 0.0, seed=0), PROMPTS, G)


def test_state_round_trip_gives_the_same_next_update():
    a = make(seed=1, head_seed=1)  # the same run seed (references), another head and patch seed
    a.update(noisy(G, 0.0, seed=0), PROMPTS, G)
    state, opt = a.state_tensors(), copy.deepcopy(a.optimizer.state_dict())  # as a checkpoint would
    assert {"reference_generator", "updates", "scorer.patch_generator", "scorer.head.layers.0.weight"} <= set(state)
    b = make(seed=1, head_seed=2)
    b.load_state_tensors(state)
    b.optimizer.load_state_dict(opt)
    assert b.updates == 1
    x = noisy(G, 0.0, seed=5)
    ma, mb = a.update(x, PROMPTS, G), b.update(x, PROMPTS, G)
    assert ma == mb
    for pa, pb in zip(a.scorer.trainable_parameters(), b.scorer.trainable_parameters()):
        assert torch.equal(pa, pb)


def test_reference_sources(tmp_path):
    Image.new("RGB", (20, 12), (255, 0, 0)).save(tmp_path / "a.png")
    Image.new("L", (8, 8), 128).save(tmp_path / "b.JPG")
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (16, 16), (0, 0, 255)).save(tmp_path / "sub" / "c.jpeg")
    (tmp_path / "notes.txt").write_text("not an image")
    refs = load_reference_folder(tmp_path, (6, 10))
    assert refs.shape == (3, 3, 6, 10) and refs.dtype == torch.uint8
    assert refs[0, :, 2, 3].tolist() == [255, 0, 0]  # PNG: exact
    assert (refs[1, :, 3, 3].int() - torch.tensor([128, 128, 128])).abs().max() <= 2  # greyscale JPEG
    assert (refs[2, :, 2, 3].int() - torch.tensor([0, 0, 255])).abs().max() <= 2
    d = make(references=str(tmp_path), reference_generator=None)
    assert d.references.shape == (3, 3, *SIZE)
    assert d.sample_references(5).shape == (5, 3, *SIZE)  # more than there are: with replacement
    with pytest.raises(ConfigError, match="not a folder"):
        load_reference_folder(tmp_path / "missing", (4, 4))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no PNG"):
        load_reference_folder(tmp_path / "empty", (4, 4))
    dark = synthetic_references("dark", SIZE, torch.Generator().manual_seed(0)).float() / 255
    bright = synthetic_references("bright", SIZE, torch.Generator().manual_seed(0)).float() / 255
    assert dark.max() <= 0.15 + 1e-6 and bright.min() >= 0.85 - 1e-6


def test_a_scorer_that_cannot_be_trained_is_a_config_error():
    cfg = AdversarialConfig(enabled=True, reward="brightness", reference_generator="dark")
    with pytest.raises(ConfigError, match="cannot be trained"):
        Discriminator(build_scorer("brightness"), cfg, SIZE, 0)
