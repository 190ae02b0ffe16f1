"""An engine that averages the training loss over its replicas (``Engine.averages_loss``: the live
mode) returns each step's mean one step late, with the reduction it voted on; the loop logs that
mean as ``train/loss`` of the step it belongs to, at that step's wall time, once per step, the
last one's from the flush. Where the engine returns none (the vote dropped the reduction) the
step gets this replica's own loss; a step a heal moved the loop past gets nothing. The real
engine over two processes: tests/distributed/test_live_loss.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.split import Split
from pipesgd.engine.base import Engine, StepStats
from pipesgd.trainer import Trainer

STEPS, PEER = 12, 10.0  # the fake peer's loss is always this replica's plus 2 * PEER: the mean is own + PEER


class AveragingEngine(Engine):
    """Applies each gradient at once and answers, as the live engine does, with the mean of the
    losses carried into the previous step's reduction (this replica's and a peer's). ``drop``:
    the steps (by call) whose vote fails (no mean); ``heal``: (call, donor's step), where the
    replica takes its donor's step inside the vote, as a live healer does."""

    averages_loss = True

    def __init__(self, optimizer, drop=(), heal=None):
        self.optimizer, self.drop, self.heal = optimizer, set(drop), heal
        self.steps, self.last, self.trainer = 0, StepStats(), None
        self.carried: list[float] = []  # the loss carried at each call, in order
        self._in_flight: float | None = None

    def carry_loss(self, loss):
        assert loss.dim() == 0 and not loss.requires_grad
        self.carried.append(float(loss))

    def step(self) -> StepStats:
        self.steps += 1
        stats = self._vote()
        if self.heal is not None and self.steps == self.heal[0]:
            self.trainer.seek(self.heal[1])
        self._in_flight = self.carried[-1]
        self.optimizer.step()
        return stats

    def _vote(self) -> StepStats:
        flight, self._in_flight = self._in_flight, None
        if flight is None or self.steps in self.drop:
            return StepStats(applied=flight is not None)
        return StepStats(applied=True, loss=flight + PEER)

    def flush(self) -> StepStats:
        self.steps += 1
        return self._vote()

    def state_dict(self) -> dict:
        return {"width": 2, "steps": self.steps, "pending": []}

    def load_state_dict(self, state: dict) -> None:
        pass


class RecordingWriter:
    def __init__(self):
        self.rows: list[tuple[int, dict, float | None]] = []

    def scalars(self, values, step, walltime=None):
        self.rows.append((step, dict(values), walltime))

    def losses(self) -> list[tuple[int, float, float | None]]:
        return [(s, v["train/loss"], w) for s, v, w in self.rows if v.get("train/loss") is not None]

    def walltimes(self) -> dict[int, float]:
        """Each step's wall time, as written with its other values."""
        return {s: w for s, v, w in self.rows if "train/lr" in v}


def _fit(lazy: bool = False, **engine_kwargs) -> tuple[AveragingEngine, RecordingWriter]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    split = Split(torch.randint(0, 256, (128, 1, 4, 4), dtype=torch.uint8, generator=gen),
                  torch.randint(0, 3, (128,), generator=gen))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, writer = AveragingEngine(optimizer, **engine_kwargs), RecordingWriter()
    trainer = Trainer(model, engine, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 100),
                      ShardedLoader(split, 8, 0, 1, seed=0), EvalLoader(split, 32, 0, 1), writer, epochs=1,
                      max_steps=STEPS, log_every=5, device=torch.device("cpu"), is_main=False)
    engine.trainer = trainer
    if lazy:
        trainer.read_every = 5  # a GPU's cadence: the means arrive in batches of records
    trainer.fit()
    return engine, writer


@pytest.mark.parametrize("lazy", [False, True])
def test_each_step_logs_the_replicas_mean_that_came_a_step_late_at_its_own_wall_time(lazy):
    engine, writer = _fit(lazy)
    own = engine.carried
    assert len(own) == STEPS
    logged = writer.losses()
    assert [s for s, _, _ in logged] == list(range(1, STEPS + 1)), "every step once, the last from the flush"
    assert [v for _, v, _ in logged] == pytest.approx([x + PEER for x in own]), "the mean, not its own loss"
    walltimes = writer.walltimes()
    assert all(w == walltimes[s] for s, _, w in logged), "at the wall time of the step it belongs to"


def test_a_step_whose_vote_dropped_the_reduction_logs_its_own_loss():
    engine, writer = _fit(drop={5})  # the vote at call 5 is on step 4's reduction
    logged = dict((s, v) for s, v, _ in writer.losses())
    assert logged[4] == pytest.approx(engine.carried[3])
    assert all(logged[s] == pytest.approx(engine.carried[s - 1] + PEER) for s in logged if s != 4)
    assert sorted(logged) == list(range(1, STEPS + 1))


def test_a_healer_logs_the_mean_at_its_donors_step_and_nothing_for_the_step_it_left():
    # at its 3rd call the replica heals to the donor's step 6: that call's record is step 7, and
    # the mean it returns (of the reduction the donor launched at step 6) belongs to step 6
    engine, writer = _fit(heal=(3, 6))
    steps = [s for s, _, _ in writer.losses()]
    assert steps == [1, 6, *range(7, STEPS + 1)], "step 2 (on weights the heal replaced) is not logged"
    logged = dict((s, v) for s, v, _ in writer.losses())
    assert logged[6] == pytest.approx(engine.carried[1] + PEER)
