"""Whom PIPESGD_FAULT targets: a rank on the job's first attempt; under the live launcher (every
replica group a lone rank-0 process), a replica group in its first process, which the launcher's
restart count tells apart from the group's restarted one."""

from __future__ import annotations

import os

import pytest

from pipesgd.reliability.faults import ENV, Fault, Faults
from pipesgd.live import launch as live_launch
from pipesgd.live.options import ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, ENV_SPAWNED, replica_attempt

SPEC = "kill:1:7,nan:0:3"


@pytest.fixture
def outside_live(monkeypatch):
    for key in (ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(ENV, SPEC)
    return monkeypatch


def test_outside_a_live_launch_a_fault_targets_its_rank_on_the_first_attempt_only(outside_live):
    assert Faults.from_env(1).mine == [Fault("kill", 1, 7)]
    assert Faults.from_env(0).mine == [Fault("nan", 0, 3)]
    outside_live.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Faults.from_env(1) is None


def test_an_ordinary_run_installs_nothing_and_a_bad_spec_is_refused_at_start(outside_live):
    """Read once, when a worker builds its hooks: no variable, no hook (the step never calls in)."""
    outside_live.delenv(ENV)
    assert Faults.from_env(0) is None
    outside_live.setenv(ENV, "kill:1")
    with pytest.raises(ValueError, match="expected kind:rank:step"):
        Faults.from_env(0)


def test_in_a_live_replica_group_the_rank_is_the_group_and_the_attempt_its_restarts(outside_live):
    outside_live.setenv(ENV_REPLICAS, "3")
    outside_live.setenv(ENV_REPLICA, "1")
    outside_live.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert replica_attempt() == (1, 0)  # no restart count: the group's first process
    faults = Faults.from_env(0)  # every group is rank 0 of a world of one
    assert faults.mine == [Fault("kill", 1, 7)] and faults.who == "replica group" and faults.rank == 1
    outside_live.setenv(ENV_REPLICA, "2")
    assert Faults.from_env(0) is None
    outside_live.setenv(ENV_REPLICA, "1")
    outside_live.setenv(ENV_RESTART, "1")  # the launcher restarted group 1: its fault is spent
    assert replica_attempt() == (1, 1)
    assert Faults.from_env(0) is None


class _Process:
    """A replica group's process that exits at once: replica 1's first one with status 1 (as a
    killed one), every other with 0. Its sentinel is a pipe's read end with the write end closed,
    which multiprocessing.connection.wait finds ready."""

    def __init__(self, env: dict[str, str], started: list[dict[str, str]]):
        self.env, self.started = env, started
        self.exitcode = None

    def start(self):
        first = not any(e[ENV_REPLICA] == self.env[ENV_REPLICA] for e in self.started)
        self.started.append(self.env)
        self.exitcode = 1 if self.env[ENV_REPLICA] == "1" and first else 0
        read, write = os.pipe()
        os.close(write)
        self.sentinel = read

    def terminate(self):
        pass

    def join(self, timeout=None):
        pass


def test_the_live_launcher_tells_a_restarted_group_its_restart_count(monkeypatch, tmp_path):
    started: list[dict[str, str]] = []

    class Lighthouse:  # a real one needs torchft; the launcher only reads its address
        address = "http://127.0.0.1:1"

        def __init__(self, options):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    class Context:
        def Process(self, target, args, name):  # noqa: N802 (multiprocessing's spelling)
            return _Process(args[0], started)

    monkeypatch.setattr(live_launch, "Lighthouse", Lighthouse)
    monkeypatch.setattr(live_launch.multiprocessing, "get_context", lambda method: Context())
    live_launch.run(lambda *a: None, ({}, str(tmp_path)), nproc=2, max_restarts=1)
    assert [(e[ENV_REPLICA], e[ENV_RESTART]) for e in started] == [("0", "0"), ("1", "0"), ("1", "1")]
    assert all(float(e[ENV_SPAWNED]) > 0 for e in started)
    for key, value in started[-1].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(ENV, SPEC)
    assert Faults.from_env(0) is None  # the restarted group does not kill itself again
