"""Test-wide settings: no model hub, two threads (one in each pytest-xdist worker), fixed seeds."""

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
    if "heavy" in (config.getoption("markexpr") or ""):
        return
    drop = [it for it in items if it.get_closest_marker("heavy")]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if id(it) not in dropped]


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
