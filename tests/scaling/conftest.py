"""Fixtures of the scaling tests: the folder where finished one-process reference runs are shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def plain_runs_dir(tmp_path_factory) -> Path:
    """One folder for the whole test session, the same for every xdist worker: the FSDP2 and ZeRO image tests
    compare against the same one-process runs and land on different workers, so a run made by one worker is
    copied by the others (tests/scaling/test_trainers_fsdp.py `_image`) instead of being made again."""
    base = tmp_path_factory.getbasetemp()
    # an xdist worker's basetemp is <session>/popen-gwN; the session folder is its parent, shared by all workers
    # (without xdist, basetemp is the session folder itself); pytest deletes old session folders
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "plain-runs"
    path.mkdir(exist_ok=True)
    return path
