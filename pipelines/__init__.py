"""Rollouts for image policies: model adapters, transition kernels, rollout plans, the sampler."""

import flowgrpo.torchvision_hook  # noqa: F401  (first: torchvision on a CPU torch; imports nothing)
