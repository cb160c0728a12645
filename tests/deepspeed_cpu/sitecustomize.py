"""Test-only, for `accelerate launch` runs under ZeRO: on PYTHONPATH, Python imports this at the start of every
process of the launch (tests/ds_shm.py says why)."""

import os

if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
    import ds_shm

    ds_shm.skip_shm_kernel()
