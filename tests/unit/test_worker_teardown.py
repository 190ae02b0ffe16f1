"""A worker's teardown after an error: on NCCL a graceful
``destroy_process_group`` waits for a hung collective until NCCL's watchdog aborts the process, so
the error that ended the run never reached the log. The worker logs the error first and aborts
the process groups; a run that ends well still destroys them gracefully."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import pipesgd.dist as pdist
import pipesgd.train as train
from pipesgd.config import Settled
from pipesgd.engine.base import ReductionError

CONTAINER = {"seed": 0, "dist": {"threads_per_worker": 1, "backend": "gloo", "timeout_s": 10.0},
             "trainer": {"trace": False, "trace_steps": 0}}


@pytest.fixture
def teardown(monkeypatch):
    """What the worker's teardown did, in order, with a graceful destroy that blocks as NCCL's does
    on a hung collective (here for 2 s, then it is recorded as having hung)."""
    events: list[str] = []
    hung = threading.Event()

    def graceful():
        if not hung.wait(2.0):
            events.append("graceful destroy hung")

    class Recorder(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.ERROR:
                events.append("logged: " + record.getMessage())

    ctx = pdist.DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2, backend="nccl",
                            device=torch.device("cpu"))
    monkeypatch.setattr(train, "_setup_logging", lambda rank, run_dir: None)
    monkeypatch.setattr(train.pdist, "init", lambda backend, timeout_s: ctx)
    monkeypatch.setattr(train.pdist, "broadcast_object", lambda obj, ctx: obj)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", graceful)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: events.append("aborted"))
    handler = Recorder()
    logging.getLogger("pipesgd").addHandler(handler)
    yield events
    hung.set()
    logging.getLogger("pipesgd").removeHandler(handler)


@pytest.mark.timeout(30)
def test_a_failed_worker_logs_its_error_then_aborts_instead_of_waiting_for_the_hung_collective(
        monkeypatch, tmp_path, teardown):
    error = ReductionError("the reduction of step 3's gradient did not finish within 8 s", None)

    def build(cfg, ctx, settled):
        raise error

    monkeypatch.setattr(train, "_build", build)
    with pytest.raises(ReductionError):
        train.worker(CONTAINER, str(tmp_path), Settled(width=1, staleness="none"))
    assert teardown == [f"logged: rank 1 failed: ReductionError: {error}", "aborted"]


@pytest.mark.timeout(30)
def test_an_interrupted_worker_aborts_without_logging_an_error_and_a_plain_destroy_is_graceful(monkeypatch, tmp_path, teardown):
    class Stop(BaseException):  # not an error of the run's: leave the log alone, still abort
        pass

    monkeypatch.setattr(train, "_build", lambda cfg, ctx, settled: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        train.worker(CONTAINER, str(tmp_path), Settled(width=1, staleness="none"))
    assert teardown == ["aborted"]
    teardown.clear()
    pdist.destroy()
    assert teardown == ["graceful destroy hung"]  # the graceful path is the one that waits
