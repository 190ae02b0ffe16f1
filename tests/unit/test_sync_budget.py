"""The host-sync budget of the engine, counted: one value read on the host per applied step (the
reduced non-finite flag every rank decides on, docs/reliability.md), none per launch, and none on
the communication thread, whatever the staleness rule, reduction and width.

A ``TorchFunctionMode`` counts the tensor methods that copy a value to the host (``item``,
``tolist``, ``cpu``, ``numpy``, ``bool``/``float``/``int``/``index``) around ``engine.step()`` on
the training thread and around every job on the communication thread. On a GPU each is a
CPU-GPU sync that stalls the pipeline.
"""

from __future__ import annotations

import pytest
import torch
from fake_dist import FakeDist
from torch import nn
from torch.overrides import TorchFunctionMode

import pipesgd.comm.base as comm_base
from pipesgd.engine.pipe import PipeSGD

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
STEPS = 6


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("staleness", ["none", "dc", "lookahead", "predict", "dga"])
@pytest.mark.parametrize("compressor", ["none", "int8", "topk", "powersgd"])
def test_one_host_read_per_applied_step_and_none_on_the_comm_thread(monkeypatch, width, staleness, compressor):
    FakeDist(2, 0, "gloo").install(monkeypatch)
    on_thread = CountHostReads()
    submit = comm_base.CommThread.submit

    def counted_submit(self, fn):
        def job():
            with on_thread:  # modes are per thread: enter it on the communication thread
                return fn()
        return submit(self, job)

    monkeypatch.setattr(comm_base.CommThread, "submit", counted_submit)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    on_caller = CountHostReads()
    applied = 0
    with PipeSGD(opt, model.parameters(), width=width, compressor=compressor, staleness=staleness,
                 max_grad_norm=1.0) as engine:
        for _ in range(STEPS):
            opt.zero_grad()
            with engine.forward_context():
                model(torch.randn(3, 4)).square().sum().backward()
            with on_caller:
                applied += engine.step().applied
        engine.flush()
    assert applied == STEPS - width + 1
    assert on_caller.seen == ["item"] * applied, on_caller.seen
    assert on_thread.seen == [], on_thread.seen


def test_ddp_mode_reads_one_value_per_step():
    """DDP mode (and local) checks every parameter's averaged gradient for NaN/inf in one reduction
    on the device, read once: the same one read per step as GradScaler's ``found_inf``."""
    from pipesgd.engine.direct import DirectEngine
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DirectEngine(opt, numel=sum(p.numel() for p in model.parameters()), wire_elem=4, world_size=2)
    counted = CountHostReads()
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(3, 4)).square().sum().backward()
        with counted:
            assert engine.step().applied
    assert counted.seen == ["item"] * STEPS, counted.seen
