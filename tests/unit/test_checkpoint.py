"""Checkpoint files (atomic, checksummed, keep-k, safe loading), RNG capture, parameter and config
digests, the replica-mismatch message and the fault-injection spec. All in-process and fast."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

import pipesgd.checkpoint as ckpt
from pipesgd.checkpoint import (FORMAT, CheckpointDir, CheckpointError, config_diff, config_digest, param_checksum,
                                rng_state, set_rng_state)
from pipesgd.faults import parse
from pipesgd.reliability import describe_mismatch


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"format": FORMAT, "step": step, "w": torch.randn(5), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}


def test_save_is_checksummed_and_keeps_the_newest_k(tmp_path):
    d = CheckpointDir(tmp_path / "checkpoints", keep=2)
    for step in (8, 16, 24):
        d.save(state(step), step)
    assert [p.name for p in d.list()] == ["step-00000024.pt", "step-00000016.pt"]
    assert sorted(p.name for p in d.dir.iterdir()) == [
        "step-00000016.pt", "step-00000016.pt.sha256", "step-00000024.pt", "step-00000024.pt.sha256"]
    sidecar = (d.dir / "step-00000024.pt.sha256").read_text()
    assert sidecar == f"{hashlib.sha256((d.dir / 'step-00000024.pt').read_bytes()).hexdigest()}  step-00000024.pt\n"
    # sha256sum -c understands the checksum file (the by-hand check the docs promise).
    assert subprocess.run(["sha256sum", "-c", "step-00000024.pt.sha256"], cwd=d.dir).returncode == 0
    loaded = d.load(d.path(24))
    assert torch.equal(loaded["w"], state(24)["w"]) and loaded["opt"]["betas"] == (0.9, 0.99)


def test_failed_write_leaves_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    d = CheckpointDir(tmp_path, keep=2)
    d.save(state(8), 8)
    real_save = torch.save

    def dies_halfway(obj, f):
        real_save(obj, f)
        raise KeyboardInterrupt  # e.g. Ctrl-C after the bytes are written, before the rename

    monkeypatch.setattr(ckpt.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        d.save(state(16), 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008.pt", "step-00000008.pt.sha256"]


def test_corrupt_newest_is_reported_and_the_previous_used(tmp_path, caplog):
    d = CheckpointDir(tmp_path, keep=3)
    for step in (8, 16, 24):
        d.save(state(step), step)
    with open(d.path(24), "r+b") as f:  # flip one byte in the middle
        f.seek(os.path.getsize(d.path(24)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    d.path(16).with_name("step-00000016.pt.sha256").unlink()  # the writer died between the renames
    with caplog.at_level(logging.WARNING):
        path, loaded = d.newest_valid()
    assert path == d.path(8) and loaded["step"] == 8
    assert "step-00000024.pt is corrupt: sha256" in caplog.text
    assert "step-00000016.pt is incomplete: its checksum file step-00000016.pt.sha256 is missing" in caplog.text


def test_all_corrupt_is_an_error_and_none_is_a_fresh_start(tmp_path):
    d = CheckpointDir(tmp_path / "none", keep=2)
    assert d.newest_valid() is None
    d = CheckpointDir(tmp_path / "bad", keep=2)
    d.save(state(8), 8)
    d.path(8).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*: .*corrupt.*trainer.resume=never"):
        d.newest_valid()


def test_leftover_temporaries_are_removed(tmp_path):
    d = CheckpointDir(tmp_path, keep=2)
    d.save(state(8), 8)
    (tmp_path / ".step-00000016.pt.abc123.tmp").write_bytes(b"partial")
    d.remove_temporaries()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_checkpoint_cannot_run_code(tmp_path):
    """A pickle that would run a shell command, with a valid checksum: weights_only refuses it."""
    marker = tmp_path / "pwned"
    d = CheckpointDir(tmp_path / "checkpoints", keep=2)
    d.save({"format": FORMAT, "evil": _RunsCode(marker)}, 8)
    with pytest.raises(CheckpointError, match=r"refusing to load checkpoint .*step-00000008.pt.*weights_only=True"):
        d.load(d.path(8))
    assert not marker.exists()


def test_rng_state_round_trip():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.randn()  # leave a cached gaussian / non-zero position behind
    saved = rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    set_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


def test_rng_state_survives_weights_only_load(tmp_path):
    d = CheckpointDir(tmp_path, keep=1)
    d.save({"format": FORMAT, "rng": rng_state()}, 1)
    set_rng_state(d.load(d.path(1))["rng"])


def test_param_checksum_is_sha256_of_parameter_bytes_in_state_dict_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if "running" not in name and "num_batches" not in name:
            h.update(t.numpy().tobytes())
    assert param_checksum(model) == h.hexdigest()
    model[1].running_mean += 1  # buffers are not parameters
    assert param_checksum(model) == h.hexdigest()
    with torch.no_grad():
        model[2].bias[0] += 1e-7
    assert param_checksum(model) != h.hexdigest()


def test_config_digest_ignores_where_and_how_often_but_not_what():
    base = {"seed": 0, "trainer": {"width": 2, "resume": "auto", "checkpoint_every": 8},
            "data": {"root": "a", "batch_size": 64}, "dist": {"nproc": 2, "timeout_s": 300}}
    moved = {**base, "trainer": {**base["trainer"], "resume": "never", "checkpoint_every": 100},
             "data": {**base["data"], "root": "b"}, "dist": {"nproc": 4, "timeout_s": 10}}
    assert config_digest(base) == config_digest(moved)
    other = {**base, "data": {**base["data"], "batch_size": 32}}
    assert config_digest(base) != config_digest(other)
    assert config_diff(ckpt.hashed_config(base), ckpt.hashed_config(other)) == ["data.batch_size: 64 -> 32"]


def test_mismatch_message_names_the_odd_ranks():
    assert describe_mismatch(["a" * 64] * 3, 8) is None
    msg = describe_mismatch(["a" * 64, "b" * 64, "a" * 64], 8)
    assert msg.startswith("replicas diverged at step 8: rank 1 differs from the majority (ranks 0, 2")
    msg = describe_mismatch(["a" * 64, "b" * 64], 4)
    assert msg == "replicas diverged at step 4: rank 0: sha256 aaaaaaaaaaaa; rank 1: sha256 bbbbbbbbbbbb"


def test_fault_spec_is_validated():
    assert [(f.kind, f.rank, f.step) for f in parse("kill:1:35, nan:0:3")] == [("kill", 1, 35), ("nan", 0, 3)]
    for bad in ("kill:1", "explode:0:3", "kill:x:3", "kill:0:0", "kill:0:3:9"):
        with pytest.raises(ValueError, match="expected kind:rank:step"):
            parse(bad)
