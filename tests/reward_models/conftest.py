"""Fixtures for reward_models tests: quantised images and a tiny random CLIP."""

import pytest

from rewards_helpers import quantised_images


@pytest.fixture
def images():
    return quantised_images(5, 40, 56)


@pytest.fixture(scope="module")
def tiny_clip():
    from reward_models.encoders import ClipBackbone

    return ClipBackbone.tiny(seed=0, device="cpu")
