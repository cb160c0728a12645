"""Rollouts for image policies: model adapters, transition kernels, rollout plans, the sampler."""

import torchvision_cpu_hook  # noqa: F401  (first: torchvision on a CPU torch; imports nothing)
