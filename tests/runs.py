"""Helpers for the tests that run pipesgd's entry points as a user would (a subprocess from the
repository root, loopback only): train / run, the run's summary, and the processes a run left."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(tempfile.mkdtemp(prefix="pipesgd-test-cache-"))
"""``data.cache_dir`` of every run a test makes as a user would: one per test session, so CIFAR-10
is extracted once (4 s) instead of once per test. Extraction itself (atomic, checked, nothing half
written) is tested with caches of its own: tests/unit/test_data.py, test_corrupt_archive_*."""
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)


def train(*overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return subprocess.run([sys.executable, "-m", "pipesgd.train", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fast(tmp_path, data_root) -> list[str]:
    return [f"data.root={data_root}", f"data.cache_dir={CACHE}", "trainer.log_every=1"]


def run(*overrides: str, tmp: Path, fault: str | None = None, prefix: tuple[str, ...] = ("-m", "pipesgd.train"),
        extra_env: dict | None = None, timeout: float = 280) -> subprocess.CompletedProcess:
    """``python <prefix> <overrides>`` from the repo root with a test tag in the environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", PIPESGD_TEST_TAG=uuid.uuid4().hex, **(extra_env or {}))
    if fault:
        env["PIPESGD_FAULT"] = fault
    data = [f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}"]
    r = subprocess.run([sys.executable, *prefix, *overrides, *data], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    r.tag = env["PIPESGD_TEST_TAG"]
    return r


def killed_and_resumed(args: list[str], tmp: Path, *, rank: int, at: int, checkpoint: int,
                       steps: int) -> tuple[dict, dict]:
    """``args`` run uninterrupted, then again with ``rank`` killed at step ``at`` (restarts allowed):
    the second resumes from the checkpoint of step ``checkpoint`` and ends on the same weights and
    evaluations as the first, its workers all gone. The two summaries (uninterrupted first)."""
    ref = run(*args, f"hydra.run.dir={tmp / 'ref'}", tmp=tmp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = run(*args, "dist.max_restarts=2", f"hydra.run.dir={tmp / 'run'}", tmp=tmp, fault=f"kill:{rank}:{at}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"does 'kill' at step {at}" in r.stderr and f"step-{checkpoint:08d}.pt" in r.stderr
    a, b = summary(tmp / "ref"), summary(tmp / "run")
    assert b["resumed_from_step"] == checkpoint and b["steps"] == steps
    assert a["param_checksum"] == b["param_checksum"], "final weights must be bit-identical"
    assert [e["test_loss"] for e in a["evals"]] == [e["test_loss"] for e in b["evals"]]
    assert not tagged_processes(r.tag)
    return a, b


def run_script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``args`` (an example script and its arguments) from the repository root, as a user starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHON=sys.executable)
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def kill_sessions(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each of ``procs`` still running with its whole session (each was started with
    ``start_new_session=True``: a torchrun job and its worker, the lighthouse), and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tagged_processes(tag: str) -> list[int]:
    """Live processes started with ``PIPESGD_TEST_TAG=tag`` in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"PIPESGD_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


_NO_MNIST = pytest.mark.skipif(not (SHARED_DATA / "mnist").is_dir(), reason=f"no MNIST under {SHARED_DATA}")


def needs_mnist(test):
    """A training run on the real MNIST: skipped without it, and ``slow`` (``pytest -m "not slow"``
    deselects it; tests/conftest.py marks the tests that take the ``shared_data`` fixture so too)."""
    return pytest.mark.slow(_NO_MNIST(test))
