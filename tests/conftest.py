"""Test-wide settings: no model hub, two threads (one in each pytest-xdist worker), fixed seeds."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torchvision_cpu_hook  # noqa: E402,F401  (torchvision on a CPU torch)
import pytest  # noqa: E402
import torch  # noqa: E402

# two threads; one per pytest-xdist worker (the README's command runs two workers: they fill the cores)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _free_port() -> int:
    """A free port for a launch's MASTER_PORT. Its ranks bind it seconds later (after their imports); a port
    from the ephemeral range (what bind(0), connect and gloo's pair sockets draw from) could be taken by another
    pytest-xdist worker's sockets in between. So: a random port below that range, from a block of its own for
    each of the first 8 workers (bind(0) beyond them, or where the ephemeral range starts too low)."""
    import random
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 49152  # the IANA range (macOS, Windows)
    block = (ephemeral_low - 10000) // 8
    candidates = []
    if worker < 8 and block >= 100:
        candidates = random.Random().sample(range(10000 + worker * block, 10000 + (worker + 1) * block), 100)
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


@pytest.fixture
def launch_ranks(tmp_path_factory):
    """`launch_ranks(script, args, world)`: run scripts/<script> in `world` processes (gloo, as torchrun
    would set them up) and fail with the stderr tail of a rank that exits non-zero; with `check=False`,
    return every rank's (exit code, stderr) instead. The ranks are forks of a server that imported the libraries
    once (tests/rank_process.py): each is still its own process running the real script."""
    import rank_process

    root = Path(__file__).resolve().parents[1]
    logs = tmp_path_factory.mktemp("rank-stderr")
    ctx = rank_process.start_server()  # now, before a test sets a launch's environment: the imports see the plain one

    def launch(script: str, args: list[str], world: int, timeout: float = 600, check: bool = True):
        port = _free_port()
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(root),
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            stderr = logs / f"{port}-{rank}.txt"
            target_args = (str(root / "scripts" / script), list(args), env, str(stderr))
            proc = ctx.Process(target=rank_process.run_script, args=target_args, daemon=False)
            proc.start()
            procs.append((proc, stderr))
        results = []
        for proc, stderr in procs:
            proc.join(timeout)
            if proc.is_alive():
                for other, _ in procs:
                    other.kill()
                raise TimeoutError(f"{script} {args}: a rank ran past {timeout} s")
            err = stderr.read_text(errors="replace") if stderr.exists() else ""
            results.append((proc.exitcode, err))
            assert proc.exitcode == 0 or not check, err[-3000:]
        return results

    return launch


@pytest.fixture
def kill_after_first_checkpoint():
    """`kill_after_first_checkpoint(script, args, run_dir, timeout)`: run scripts/<script> in a real process,
    SIGKILL it as soon as a checkpoint exists under run_dir/checkpoints, and return that checkpoint's step."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from flowgrpo.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

    root = Path(__file__).resolve().parents[1]

    def run(script: str, args: list[str], run_dir: Path, timeout: float = 300) -> int:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(root / "scripts" / script), *args, f"output_dir={run_dir}"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + timeout
            while not list_checkpoints(run_dir / "checkpoints"):
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, f"no checkpoint within {timeout} s"
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == -signal.SIGKILL
        return load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), restore_rng=False).step

    return run


# The heavy tier: image-model runs of many iterations and multi-process runs. `pytest` leaves them out (the
# default tier, a few minutes); `pytest -m heavy` runs them (CI and the README's command run both).
HEAVY_MODULES = {
    "tests/t2i/test_learning.py",  # every recipe learns, against its lr=0 control
    "tests/t2i/test_resume.py",  # bit-identical resume of image recipes, SIGKILL included
    "tests/t2i/test_two_process.py",  # two ranks against one, image trainer
    "tests/text/test_two_process.py",  # two ranks against one, text trainer
}


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    for item in items:
        if Path(str(item.fspath)).resolve().relative_to(root).as_posix() in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)
    if _heavy_tier(config):
        workers = getattr(config, "workerinput", {}).get("workercount", 1)
        items[:] = longest_first(items, json.loads(EXPECTED_SECONDS.read_text()), workers)
        return
    drop = [it for it in items if it.get_closest_marker("heavy")]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if id(it) not in dropped]


def _heavy_tier(config) -> bool:
    expr = config.getoption("markexpr") or ""
    return "heavy" in expr and "not heavy" not in expr


# Seconds of the heavy tier's slowest tests (`--durations` of a 2-worker run on a shared machine: only their
# order is used). With `-n 2` the tier ends when its last long test does: started last, a 90 s test keeps one
# worker busy while the other idles. So the known long tests go first, longest first (the rest keep their
# collection order), and pytest_configure below makes xdist hand them out one at a time. The default tier
# keeps xdist's chunks (thousands of short tests; a module's tests stay on one worker, its fixtures built
# once). Regenerate the table from `--durations` when a test's cost changes by much; a test missing from it
# runs in its collection place.
EXPECTED_SECONDS = Path(__file__).with_name("expected_seconds.json")


def longest_first(items: list, seconds: dict[str, float], workers: int) -> list:
    """`items` with those in `seconds` first, longest first (a stable sort: the others keep their order). The
    first 2 x `workers` are dealt as xdist's load scheduler starts (two consecutive items to each worker):
    worker k gets the k-th longest and its mirror, so no worker starts with the two longest."""
    ranked = sorted(items, key=lambda it: -seconds.get(it.nodeid, 0.0))
    head = [it for it in ranked[: 2 * workers] if it.nodeid in seconds]
    if workers > 1 and len(head) == 2 * workers:
        ranked[: 2 * workers] = [it for k in range(workers) for it in (head[k], head[2 * workers - 1 - k])]
    return ranked


def pytest_configure(config):
    # xdist's load scheduler (xdist/scheduler/load.py) sends each worker a chunk of a quarter of its share in
    # collection order, then refills by chunks: the longest tests, first in that order, would all land on one
    # worker. One at a time (`--maxschedchunk=1`, unless given) they go to whichever worker is free.
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput") and _heavy_tier(config):
        if config.getoption("maxschedchunk", None) is None:
            config.option.maxschedchunk = 1


@pytest.fixture
def saved_for_backward():
    """`saved_for_backward(fn)`: (bytes autograd keeps for backward while `fn()` runs, its result); what
    activation checkpointing must shrink."""

    def measure(fn):
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return saved[0], out

    return measure
