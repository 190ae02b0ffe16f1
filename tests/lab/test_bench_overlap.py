"""The overlap benchmark (pipesgd_lab/bench/overlap.py): its arithmetic, and its clock against the
engine's exposed communication on fake CUDA (tests/lab/test_overlap_nccl.py runs it on NCCL)."""

import pytest
import torch
from fake_cuda import FakeCuda
from fake_dist import FakeDist
from torch import nn

import pipesgd.engine.exchange as exchange
from pipesgd.comm.streams import CudaStreams
from pipesgd.engine.pipe import PipeSGD
from pipesgd_lab.bench.overlap import summarize


def test_overlap_is_the_hidden_share_of_the_shorter_phase_on_the_slowest_rank():
    fast = {"compute": [10.0, 10.0, 12.0], "comm": [4.0, 4.0, 4.0], "both": [11.0, 11.0, 11.0]}
    slow = {"compute": [20.0, 20.0, 20.0], "comm": [5.0, 5.0, 5.0], "both": [21.0, 22.0, 21.0]}
    result = summarize([fast, slow])
    assert result["median_ms"] == {"compute": 20.0, "comm": 5.0, "both": 21.0}
    assert result["overlap"] == pytest.approx((20 + 5 - 21) / 5)
    assert result["spread_ms"]["both"] == [11.0, 22.0]


def test_serial_phases_overlap_nothing():
    t = {"compute": [10.0], "comm": [5.0], "both": [15.0]}
    assert summarize([t, t])["overlap"] == 0.0


def test_exposed_communication_is_timed_from_where_the_training_stream_starts_waiting(monkeypatch):
    """Before the fix, with a deadline (the trainer's engines always have one) the host waited
    for the slow reduction in finish() before the stall's first event was recorded, so the
    trainer's exposed communication read ~0 while the overlap bench (no deadline) saw the stall.
    On a communication stream still 40 ms from done, both read ~40 ms."""
    from pipesgd_lab.bench.overlap import Clock
    from pipesgd.comm import ring_allreduce
    from pipesgd.engine.exchange import GradientExchange

    fake = FakeCuda(monkeypatch, devices=1)
    FakeDist(2, 0, "nccl").install(monkeypatch)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(exchange, "streams_for", lambda d: CudaStreams(device))
    fake.lands_when_waited, fake.landing_ms = True, 40
    model = nn.Linear(8, 4)

    def slow_step(engine) -> float:
        model(torch.randn(2, 8)).square().sum().backward()
        fake.device_done.clear()  # the reduction queued by this step is 40 ms from its end
        return engine.step().exposed_s() * 1e3

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PipeSGD(opt, model.parameters(), width=1, timeout_s=30) as engine:  # as the trainer builds it
        trainer_ms = slow_step(engine)

    bench = GradientExchange(list(model.parameters()), "none", ring_allreduce)  # bench/overlap.py's path
    try:
        model(torch.randn(2, 8)).square().sum().backward()
        handle = bench.launch()
        fake.device_done.clear()
        bench_ms = Clock(device).time(lambda: handle.wait())()
    finally:
        bench.close()
    assert bench_ms >= 40
    assert abs(trainer_ms - bench_ms) <= 5, (trainer_ms, bench_ms)
