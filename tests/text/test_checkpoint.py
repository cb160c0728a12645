"""flowgrpo.checkpoint: atomic save, keep-last-k, no pickle, exact state round trip, crash mid-save."""

import json
import random

import numpy as np
import pytest
import torch

from flowgrpo.checkpoint import format as ck  # save_checkpoint looks `_save_tensors` up here (patched below)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))


def _trained(steps=3):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        loss = m(torch.arange(5)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return m, opt, sched


def _save(root, step, m, opt, sched, **kw):
    return ck.save_checkpoint(
        root,
        step,
        tensors={"model": dict(m.named_parameters())},
        optimizers={"policy": opt},
        schedulers={"lr": sched},
        state={"data": {"epoch": 1, "position": 7}},
        config={"lr": 1e-2, "name": "x"},
        **kw,
    )


def test_round_trip_is_exact(tmp_path):
    m, opt, sched = _trained()
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    path = _save(tmp_path, 3, m, opt, sched)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)

    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    loaded = ck.load_checkpoint(path, optimizers={"policy": opt2}, schedulers={"lr": sched2})
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect[0]) and got[1:] == expect[1:]
    ck.load_into(m2, loaded.tensors["model"])
    assert loaded.step == 3 and loaded.state == {"data": {"epoch": 1, "position": 7}}
    assert loaded.config == {"lr": 1e-2, "name": "x"}
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    assert opt2.param_groups[0]["betas"] == (0.8, 0.99) and isinstance(opt2.param_groups[0]["betas"], tuple)
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # the next optimizer step is identical
    for model, o in ((m, opt), (m2, opt2)):
        model(torch.arange(5)).pow(2).mean().backward()
        o.step()
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n


def test_rng_restored(tmp_path):
    m, opt, sched = _trained(1)
    torch.manual_seed(42)
    path = _save(tmp_path, 1, m, opt, sched)
    want = torch.rand(4)
    torch.manual_seed(0)
    ck.load_checkpoint(path)
    assert torch.equal(torch.rand(4), want)


def test_no_pickle_only_safetensors_and_json(tmp_path):
    m, opt, sched = _trained()
    path = _save(tmp_path, 3, m, opt, sched)
    names = sorted(p.name for p in path.iterdir())
    assert all(n.endswith((".safetensors", ".json")) for n in names), names
    json.loads((path / "state.json").read_text())


def test_tied_weights_saved_once(tmp_path):
    emb = torch.nn.Embedding(6, 3)
    head = torch.nn.Linear(3, 6, bias=False)
    head.weight = emb.weight
    tensors = {"emb.weight": emb.weight, "head.weight": head.weight}
    path = ck.save_checkpoint(tmp_path, 1, tensors={"model": tensors})
    back = ck.load_checkpoint(path, restore_rng=False).tensors["model"]
    assert torch.equal(back["emb.weight"], emb.weight) and torch.equal(back["head.weight"], emb.weight)


def test_keep_last_and_latest(tmp_path):
    m, opt, sched = _trained(1)
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, m, opt, sched, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]
    assert ck.latest_checkpoint(tmp_path).name == "step_00000008"
    assert ck.latest_checkpoint(tmp_path / "missing") is None


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    m, opt, sched = _trained(1)
    good = _save(tmp_path, 1, m, opt, sched, keep_last=1)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    real = ck._save_tensors
    calls = []

    def explode(tensors, path):  # the model file is written, then the optimizer write dies
        calls.append(path.name)
        if path.name.startswith("optim."):
            raise OSError("disk full (simulated)")
        return real(tensors, path)

    monkeypatch.setattr(ck, "_save_tensors", explode)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    # one line naming the checkpoint's folder and the OS error (the CLI prints a CheckpointError so, exit 2)
    with pytest.raises(
        ck.CheckpointError, match=f"could not save checkpoint {tmp_path / 'step_00000002'}: .*simulated"
    ):
        _save(tmp_path, 2, m, opt, sched, keep_last=1)
    assert calls[0] == "tensors.model.safetensors"
    assert ck.latest_checkpoint(tmp_path) == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [good.name]  # no half-written folder left

    # a crash that left a temporary folder behind (process killed) is ignored, then cleaned up
    (tmp_path / ".tmp-step_00000003-dead").mkdir()
    (tmp_path / ".tmp-step_00000003-dead" / "tensors.model.safetensors").write_bytes(b"garbage")
    assert ck.latest_checkpoint(tmp_path) == good
    monkeypatch.setattr(ck, "_save_tensors", real)
    new = _save(tmp_path, 3, m, opt, sched, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.name]


def test_a_full_disk_is_one_line_naming_the_folder_and_the_os_error(tmp_path, monkeypatch):
    """safetensors reports a failed write as its own error (not an OSError): still a CheckpointError naming the
    checkpoint and the OS error, the temporary folder removed, the previous checkpoint intact."""
    from safetensors import SafetensorError

    m, opt, sched = _trained(1)
    good = _save(tmp_path, 1, m, opt, sched)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(ck.CheckpointError) as err:
        _save(tmp_path, 2, m, opt, sched)
    message = str(err.value)
    assert f"could not save checkpoint {tmp_path / 'step_00000002'}" in message and "No space left" in message
    assert "\n" not in message and "intact" in message
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before

    def denied(*args, **kwargs):  # a read-only folder: the temporary folder cannot even be made
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(ck.tempfile, "mkdtemp", denied)
    with pytest.raises(
        ck.CheckpointError, match="could not save checkpoint .*step_00000003: EACCES: Permission denied"
    ):
        _save(tmp_path, 3, m, opt, sched)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


def test_a_resave_that_fails_puts_the_step_s_checkpoint_back(tmp_path, monkeypatch):
    """Re-saving a step moves its old checkpoint aside first: a rename that then fails puts it back (it was left
    as a `.old-` folder, which the next save removed)."""
    import os

    m, opt, sched = _trained(1)
    good = _save(tmp_path, 4, m, opt, sched)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    real = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".tmp-step_00000004"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "rename", rename)
    with pytest.raises(ck.CheckpointError, match="ENOSPC"):
        _save(tmp_path, 4, m, opt, sched)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before


def test_incomplete_folder_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    assert ck.latest_checkpoint(tmp_path) is None
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint"):
        ck.load_checkpoint(tmp_path / "step_00000005")


def test_resave_same_step_replaces_it(tmp_path):
    m, opt, sched = _trained(1)
    _save(tmp_path, 4, m, opt, sched)
    with torch.no_grad():
        m[1].bias.fill_(3.0)
    path = _save(tmp_path, 4, m, opt, sched)
    back = ck.load_checkpoint(path, restore_rng=False).tensors["model"]
    assert torch.all(back["1.bias"] == 3.0)


def test_load_into_rejects_unknown_and_misshaped(tmp_path):
    m = _model()
    with pytest.raises(ck.CheckpointError, match="not in the model"):
        ck.load_into(m, {"nope": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="shape"):
        ck.load_into(m, {"1.bias": torch.zeros(3)})


def test_a_folder_moved_into_a_checkpoint_is_verified_like_its_files(tmp_path):
    """A sharded run's `sharded/` folder (written by every rank beforehand) moves into the checkpoint before its
    atomic rename; its files are in the manifest, so a damaged shard makes resume fall back."""
    from flowgrpo.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint

    root = tmp_path / "ckpt"
    for step in (1, 2):
        staging = root / f".tmp-shards-{step}"
        staging.mkdir(parents=True)
        (staging / "shard-00001.safetensors").write_bytes(b"rank 0's shards %d" % step)
        path = save_checkpoint(root, step, state={}, folders={"sharded": staging})
        assert not staging.exists() and (path / "sharded" / "shard-00001.safetensors").is_file()
        assert verify_checkpoint(path) == []
        assert oct((path / "sharded").stat().st_mode & 0o700) == oct(0o700)  # a folder stays listable
    (path / "sharded" / "shard-00001.safetensors").write_bytes(b"rank 0's shards X")
    assert verify_checkpoint(path) == ["sharded/shard-00001.safetensors differs from what was saved (sha256)"]
    with pytest.warns(UserWarning, match="damaged"):
        assert latest_checkpoint(root, verify=True).name == "step_00000001"
