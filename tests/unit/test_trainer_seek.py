"""A live replica group that heals takes its donor's step (pipesgd.train._share_position hands the
loop's step through ``Engine.register_state``); its data then follows: from the next step on it
draws, in its own shard, exactly the batches an uninterrupted group draws at those steps; it
evaluates where its peers do from the step it lands on, and its curve starts with its donor's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.split import Split
from pipesgd.engine.base import Engine, StepStats
from pipesgd.train import _share_position
from pipesgd.trainer import Trainer, TrainerHooks

SAMPLES, BATCH, SHARDS, SHARD, EPOCHS = 96, 8, 2, 1, 3  # 6 batches per epoch in each shard, 18 steps


class IndexModel(nn.Module):
    """Notes which samples each forward saw (sample i's pixels are all i)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen: list[list[int]] = []

    def forward(self, x):
        if self.training:
            self.seen.append(torch.round(x[:, 0, 0, 0] * 255).long().tolist())
        return self.linear(x.flatten(1))


class HealingEngine(Engine):
    """Applies each gradient at once; at its ``heal_at``-th step loads a donor's registered state
    as the live engine does inside the vote (only the loop's step here)."""

    def __init__(self, optimizer, heal_at: int | None = None, donor_step: int = 0, donor_evals: list | None = None):
        self.optimizer, self.heal_at, self.donor_step = optimizer, heal_at, donor_step
        self.donor_evals = donor_evals or []
        self.loads: dict = {}
        self.steps = 0
        self.last = StepStats()

    def register_state(self, key, save, load):
        self.loads[key] = load

    def step(self) -> StepStats:
        self.steps += 1
        if self.steps == self.heal_at:
            self.loads["trainer_step"](self.donor_step)
            self.loads["evals"](self.donor_evals)
        self.optimizer.step()
        return StepStats(applied=True)

    def flush(self) -> StepStats:
        return StepStats()

    def state_dict(self) -> dict:
        return {"width": 1, "steps": self.steps, "pending": []}

    def load_state_dict(self, state: dict) -> None:
        pass


class Batches(TrainerHooks):
    """The batch each step trained on, and the positions the loop reported."""

    def __init__(self, model: IndexModel):
        self.model, self.by_step, self.positions = model, {}, {}

    def on_step_end(self, trainer, epoch, consumed):
        self.by_step[trainer.step] = self.model.seen[-1]
        self.positions[trainer.step] = (epoch, consumed)


def _run(heal_at: int | None = None, donor_step: int = 0, eval_every_steps: int | None = None,
         donor_evals: list | None = None) -> tuple[Batches, Trainer]:
    torch.manual_seed(0)
    images = torch.arange(SAMPLES, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    split = Split(images, torch.zeros(SAMPLES, dtype=torch.int64))
    model = IndexModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    engine = HealingEngine(optimizer, heal_at, donor_step, donor_evals)
    hooks = Batches(model)
    trainer = Trainer(model, engine, optimizer, scheduler, ShardedLoader(split, BATCH, SHARD, SHARDS, seed=3),
                      EvalLoader(split, 32, 0, 1), _NullWriter(), epochs=EPOCHS, max_steps=None, log_every=100,
                      device=torch.device("cpu"), is_main=False, hooks=hooks, eval_every_steps=eval_every_steps)
    _share_position(engine, scheduler, trainer)
    trainer.fit()
    return hooks, trainer


class _NullWriter:
    def scalars(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("heal_at,donor_step", [
    (3, 4),    # the donor a step ahead, same epoch
    (3, 11),   # into the next epoch
    (2, 6),    # to the very start of an epoch (the donor just ended one)
    (9, 16),   # from the second epoch into the last
])
def test_a_healed_replica_draws_the_batches_an_uninterrupted_one_draws_at_its_new_step(heal_at, donor_step):
    steady, _ = _run()
    per_epoch = SAMPLES // SHARDS // BATCH
    assert sorted(steady.by_step) == list(range(1, EPOCHS * per_epoch + 1))
    healed, _ = _run(heal_at, donor_step)
    joined = donor_step + 1  # the step in which it healed (its own, stale batch): the loop counts it as the donor's
    after = sorted(s for s in healed.by_step if s > joined)
    assert after == list(range(joined + 1, EPOCHS * per_epoch + 1)), "the healer stopped early or ran over"
    assert {s: healed.by_step[s] for s in after} == {s: steady.by_step[s] for s in after}
    # a checkpoint taken in the healing step would resume where the uninterrupted run stands
    epoch, consumed = steady.positions[joined]
    whole = per_epoch * BATCH * SHARDS  # the end of an epoch is the start of the next
    assert healed.positions[joined] == ((epoch + 1, 0) if consumed == whole else (epoch, consumed))


@pytest.mark.parametrize("heal_at,donor_step", [
    (3, 7),  # it lands on step 8, an in-epoch evaluation (every 4 steps)
    (3, 5),  # on step 6, an epoch's end
    (3, 4),  # on step 5, no evaluation
])
def test_a_healed_replica_takes_its_donors_evaluations_and_evaluates_where_its_peers_do_from_its_new_step(heal_at, donor_step):
    """Under live recovery the groups of a quorum average their buffers and losses at each
    evaluation (pipesgd.live.peers): a healer that skipped the one at the step it lands on would
    leave its peers without it (and they would wait for it until the live timeout)."""
    _, steady = _run(eval_every_steps=4)
    assert [e["step"] for e in steady.history.evals] == [4, 6, 8, 12, 16, 18]  # every 4 steps, epoch ends, the end
    joined = donor_step + 1
    donors = [{"step": e["step"], "from": "the donor"} for e in steady.history.evals if e["step"] < joined]
    _, healed = _run(heal_at, donor_step, eval_every_steps=4, donor_evals=donors)
    after = lambda t: [(e["step"], e["epoch"]) for e in t.history.evals if e["step"] >= joined]  # noqa: E731
    assert after(healed) == after(steady)
    # its curve: the donor's evaluations up to the heal (its own, of its old weights, replaced), then its own
    assert healed.history.evals[:len(donors)] == donors and len(healed.history.evals) == len(steady.history.evals)
