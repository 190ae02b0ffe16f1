"""The trainer reads device values lazily (docs/gpu.md, "How the NCCL path works"): a step's loss and its device
times (compute, the reduction, the training stream's stall) stay on the device until a log point,
where one read takes them all; what is written is what an eager read would have written.

On the CPU the trainer reads every step (a read costs nothing there); these tests set the GPU's
cadence by hand and time with fake spans that note when they are read.
"""

from __future__ import annotations

import pytest
import torch
from fake_dist import FakeDist
from torch import nn

import pipesgd.engine.exchange as exchange
from pipesgd.comm.streams import HostClock, HostSpan
from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.split import Split
from pipesgd.engine.base import StepStats
from pipesgd.engine.direct import DirectEngine
from pipesgd.engine.pipe import PipeSGD
from pipesgd.trainer import Trainer, TrainerHooks

LOG_EVERY = 4
STEPS = 10


class RecordingWriter:
    def __init__(self):
        self.rows: list[tuple[int, dict, float | None]] = []

    def scalars(self, values, step, walltime=None):
        self.rows.append((step, dict(values), walltime))

    def hparams(self, *args, **kwargs):
        pass

    def close(self):
        pass


class UnreadAtStepEnd(TrainerHooks):
    def __init__(self):
        self.unread: list[int] = []

    def on_step_end(self, trainer, epoch, consumed):
        self.unread.append(len(trainer._unread))


class NotedSpan:
    """A device time that notes the trainer's step when it is read."""

    def __init__(self, value: float, reads: list, trainer_ref: list):
        self.value, self.reads, self.trainer_ref = value, reads, trainer_ref

    def seconds(self) -> float:
        self.reads.append(self.trainer_ref[0].step)
        return self.value


class NotedClock:
    def __init__(self, reads: list, trainer_ref: list):
        self.reads, self.trainer_ref, self.n = reads, trainer_ref, 0

    def start(self):
        return None

    def stop(self, mark):
        self.n += 1
        return NotedSpan(self.n / 1000, self.reads, self.trainer_ref)


def _trainer(lazy: bool, engine_factory=None, clock=None):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    split = Split(torch.randint(0, 256, (96, 1, 4, 4), dtype=torch.uint8, generator=gen),
                  torch.randint(0, 3, (96,), generator=gen))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = (engine_factory or (lambda o, m: PipeSGD(o, m.parameters(), width=2)))(opt, model)
    writer, hooks = RecordingWriter(), UnreadAtStepEnd()
    trainer = Trainer(model, engine, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                      ShardedLoader(split, 8, 0, 1, seed=0), EvalLoader(split, 32, 0, 1), writer,
                      epochs=1, max_steps=STEPS, log_every=LOG_EVERY, device=torch.device("cpu"),
                      is_main=False, hooks=hooks)
    assert trainer.read_every == 1 and isinstance(trainer.clock, HostClock)  # the CPU's defaults
    if lazy:
        trainer.read_every = LOG_EVERY  # a GPU's
    if clock is not None:
        trainer.clock = clock
    return trainer, writer, hooks


def test_a_gpu_cadence_reads_at_log_points_and_writes_what_an_eager_read_writes():
    eager, eager_writer, eager_hooks = _trainer(lazy=False)
    eager_result = eager.fit()
    lazy, lazy_writer, lazy_hooks = _trainer(lazy=True)
    lazy_result = lazy.fit()
    assert eager_hooks.unread == [0] * STEPS
    # nothing read between log points (steps 4 and 8) and at the last step
    assert lazy_hooks.unread == [1, 2, 3, 0, 1, 2, 3, 0, 1, 0]

    def train_rows(rows):
        return [(step, v["train/loss"], v["train/lr"], v.get("train/staleness")) for step, v, _ in rows
                if "train/loss" in v]

    assert train_rows(lazy_writer.rows) == train_rows(eager_writer.rows)
    assert [r[0] for r in train_rows(lazy_writer.rows)] == list(range(1, STEPS + 1))
    # each step's row carries the wall time of that step, not of the read
    walls = [w for _, v, w in lazy_writer.rows if "train/loss" in v]
    assert walls == lazy.history.wall_time and walls == sorted(walls)
    assert lazy.last_losses == eager.last_losses and len(lazy.last_losses) == STEPS
    assert lazy_result["test_accuracy"] == eager_result["test_accuracy"]
    assert lazy_result["final_train_loss"] == eager_result["final_train_loss"]


def test_device_times_are_read_only_at_log_points_and_land_in_the_history():
    reads, ref = [], []
    trainer, writer, _ = _trainer(lazy=True, clock=NotedClock(reads, ref))
    ref.append(trainer)
    trainer.fit()
    # read in batches: the four steps up to 4 at step 4, up to 8 at 8, then 9 and 10 at the end
    assert reads == [4] * 4 + [8] * 4 + [10] * 2
    assert trainer.history.compute_ms == pytest.approx([n for n in range(1, STEPS + 1)])
    assert [v["time/compute_ms"] for _, v, _ in writer.rows if "time/compute_ms" in v] == \
        pytest.approx(trainer.history.compute_ms)


def test_a_non_finite_loss_stops_a_policy_free_engine_at_the_step_that_had_it():
    class NoPolicy(DirectEngine):
        """An engine that leaves non-finite values to the trainer (as ps does)."""

        def __init__(self, optimizer):
            super().__init__(optimizer, numel=0, wire_elem=4, world_size=1)
            self.nonfinite = None

        def step(self):
            self.optimizer.step()
            return StepStats(applied=True)

    forwards = {"n": 0}

    def engine(opt, model):
        def poison(module, args, out):
            forwards["n"] += 1
            return out * float("nan") if forwards["n"] == 6 else out
        model.register_forward_hook(poison)
        return NoPolicy(opt)

    trainer, _, _ = _trainer(lazy=True, engine_factory=engine)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 6 \(epoch 0\)"):
        trainer.fit()
    assert trainer.step == 8  # found at the log point after it, on a GPU's cadence


@pytest.mark.parametrize("width", [1, 2])
def test_the_engine_reports_the_device_times_its_streams_measured(monkeypatch, width):
    """With device timing (a GPU), the applied reduction's time and the training stream's stall
    come from the streams' spans; the host's clocks only measured queueing."""
    FakeDist(2, 0, "gloo").install(monkeypatch)

    class TimedStreams:
        def ready(self, *tensors):
            return None

        def run(self, ready, fn):
            return fn(), "done"

        def begin_wait(self):
            return None

        def wait(self, done, timeout=None, begun=None):
            return HostSpan(0.002)

        def span(self, done):
            return HostSpan(0.030)

    monkeypatch.setattr(exchange, "streams_for", lambda device: TimedStreams())
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = []
    with PipeSGD(opt, model.parameters(), width=width) as engine:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            stats = engine.step()
            if stats.applied:
                applied.append(stats)
        engine.flush()
    assert len(applied) == 4 - width + 1
    for stats in applied:
        assert [s.seconds() for s in stats.comm.spans] == [0.030]
        assert stats.comm.time_s() == 0.030 and stats.exposed_s() == 0.002


def test_batches_go_to_a_gpu_through_pinned_memory_asynchronously(monkeypatch):
    from pipesgd.trainer import batch_to_device
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, **kw: calls.append((str(device), kw)) or t)
    batch_to_device(torch.ones(2), torch.device("cuda", 1))
    assert calls == ["pin", ("cuda:1", {"non_blocking": True})]
    calls.clear()
    batch_to_device(torch.ones(2), torch.device("cpu"))
    assert calls == [("cpu", {})]  # nothing to pin for, nothing asynchronous
