"""The commit a run's summary names: the one it started on (the code it imported), with the one at
its end beside it only where the checkout moved while it ran. A record read at the end named
whatever the checkout held when a long run finished, code the run never imported."""

from __future__ import annotations

import pytest
import torch

import pipesgd.dist as pdist
from pipesgd import train
from pipesgd.config import Settled
from pipesgd.observability.runinfo import commit_fields


def test_a_run_on_a_still_checkout_names_one_commit():
    assert commit_fields("abc", "abc") == {"git_commit": "abc"}


def test_a_run_whose_checkout_moved_names_the_start_and_adds_the_end():
    assert commit_fields("abc", "def-dirty") == {"git_commit": "abc", "git_commit_at_end": "def-dirty"}


@pytest.mark.timeout(30)
def test_the_worker_reads_the_commit_before_it_builds_anything(monkeypatch, tmp_path):
    events: list[str] = []

    class Built(Exception):
        pass

    def build(cfg, ctx, settled):
        events.append("build")
        raise Built

    ctx = pdist.DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
                            device=torch.device("cpu"))
    monkeypatch.setattr(train, "_setup_logging", lambda rank, run_dir: None)
    monkeypatch.setattr(train.pdist, "init", lambda backend, timeout_s: ctx)
    monkeypatch.setattr(train.pdist, "broadcast_object", lambda obj, ctx: obj)
    monkeypatch.setattr(train.pdist, "destroy", lambda abort=False: None)
    monkeypatch.setattr(train, "git_commit", lambda: events.append("commit") or "abc")
    monkeypatch.setattr(train, "_build", build)
    container = {"seed": 0, "dist": {"threads_per_worker": 1, "backend": "gloo", "timeout_s": 10.0},
                 "trainer": {"trace": False, "trace_steps": 0}}
    with pytest.raises(Built):
        train.worker(container, str(tmp_path), Settled(width=1, staleness="none"))
    assert events == ["commit", "build"]
