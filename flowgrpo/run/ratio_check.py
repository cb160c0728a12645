"""The live on-policy check: the first pass over a fresh rollout is scored by the weights that sampled it,
so its ratio must be exactly 1. Both trainers measure it with `FirstPassCheck` and warn with one class."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from ..distributed import Distributed

log = logging.getLogger(__name__)


class OnPolicyRatioWarning(UserWarning):
    """The first pass over a fresh rollout did not give ratio 1."""


@dataclass
class FirstPassCheck:
    """max |ratio - 1| over the rows scored before the first optimizer step of a training step."""

    enabled: bool
    tolerance: float
    deviation: float = 0.0
    rows: int = 0

    def observe(self, deviation: float, rows: int) -> None:
        self.deviation = max(self.deviation, deviation)
        self.rows += rows

    def reduce(self, dist: Distributed) -> None:
        """Every rank's rows: the largest deviation, the summed row count."""
        if dist.active:
            self.deviation, self.rows = dist.max(self.deviation), int(dist.sum(self.rows))

    def report(self, record: dict[str, Any], where: str, suspects: str) -> None:
        """Write check/first_pass_ratio_dev and check/rows (0 rows: nothing was trained on); warn when the
        deviation is past the tolerance."""
        if not self.enabled:
            return
        record["check/first_pass_ratio_dev"] = self.deviation
        record["check/rows"] = self.rows
        if self.deviation > self.tolerance:
            msg = (
                f"ON-POLICY CHECK FAILED at {where}: re-scoring the fresh rollout with the weights that sampled it "
                f"gives |ratio - 1| up to {self.deviation:.3e} (tolerance {self.tolerance:.1e}). {suspects}"
            )
            log.warning(msg)
            warnings.warn(msg, OnPolicyRatioWarning, stacklevel=3)
