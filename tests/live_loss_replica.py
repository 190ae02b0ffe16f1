"""One replica group of a live run, for tests/distributed/test_live_loss.py: the trainer's loop
(``Trainer.fit``) with LiveEngine for ``--steps`` steps on its own shard of the data, its metric
writer recording what it logs. After every step one JSON line in ``<out>.jsonl``: the loop's step
and this group's own loss of that step. At the end ``<out>`` (JSON): every value it logged per
step (``train/loss`` and the engine's ``live/valid``, by step) and how often it healed.
``--pause-at K``: after step K, wait (up to a minute) until the file ``--go`` exists, so that a
group started later joins this one mid-run and heals from it."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live_metric_replica import eval_split, make_eval_model  # noqa: E402
from live_replica import make_optimizer, replica_arguments  # noqa: E402
from pipesgd.data.loader import EvalLoader, ShardedLoader  # noqa: E402
from pipesgd.data.split import Split  # noqa: E402
from pipesgd.live.engine import LiveEngine  # noqa: E402
from pipesgd.live.options import LiveOptions  # noqa: E402
from pipesgd.objective import Classification  # noqa: E402
from pipesgd.train import _share_position  # noqa: E402
from pipesgd.trainer import Trainer, TrainerHooks  # noqa: E402

GROUPS = 2  # the data's shards: group r reads shard r


def train_split() -> Split:
    """Enough samples that no epoch ends in a test (62 batches of 16 per shard), the same everywhere."""
    g = torch.Generator().manual_seed(3)
    return Split(torch.randint(0, 256, (2000, 1, 2, 4), generator=g, dtype=torch.uint8),
                 torch.randint(0, 4, (2000,), generator=g))


class Recorder:
    """The metric writer: every value logged, by tag and step."""

    def __init__(self):
        self.logged: dict[str, dict[int, float]] = {}

    def scalars(self, values, step, walltime=None):
        for tag, value in values.items():
            if value is not None:
                self.logged.setdefault(tag, {})[step] = value

    def hparams(self, *args, **kwargs):
        pass

    def close(self):
        pass


class OwnLoss(Classification):
    """The objective, noting each training loss it computes (this group's own)."""

    def __init__(self):
        super().__init__()
        self.last: float | None = None

    def loss(self, output, target):
        loss = super().loss(output, target)
        self.last = float(loss)
        return loss


class Steps(TrainerHooks):
    """One line per step: the loop's step (after a heal: the donor's) and the group's own loss."""

    def __init__(self, out, objective: OwnLoss, pause_at: int | None, go: str | None):
        self.out, self.objective, self.pause_at, self.go = out, objective, pause_at, go

    def on_step_end(self, trainer, epoch, consumed):
        self.out.write(json.dumps({"step": trainer.step, "own": self.objective.last}) + "\n")
        if trainer.step == self.pause_at:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.go):  # the test starts the late group, then says go
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.go} did not appear within 60 s")
                time.sleep(0.05)


def main() -> None:
    p = replica_arguments()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--pause-at", type=int)
    p.add_argument("--go")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[replica {a.replica}] %(name)s %(message)s")
    torch.set_num_threads(1)
    model = make_eval_model()  # seeded alike: the groups start from the same weights
    optimizer, scheduler = make_optimizer(model)
    engine = LiveEngine(model, optimizer, LiveOptions(a.lighthouse, a.run_id, a.replica, timeout_s=10,
                                                      quorum_timeout_s=30, min_replicas=a.min_replicas,
                                                      init_sync=False))
    objective, writer = OwnLoss(), Recorder()
    with open(f"{a.out}.jsonl", "w", buffering=1) as out:
        trainer = Trainer(model, engine, optimizer, scheduler, ShardedLoader(train_split(), 16, a.replica, GROUPS,
                                                                             seed=0),
                          EvalLoader(eval_split(), 16, 0, 1), writer, epochs=1, max_steps=a.steps, log_every=1000,
                          device=torch.device("cpu"), is_main=False, eval_max_batches=2, objective=objective,
                          hooks=Steps(out, objective, a.pause_at, a.go))
        _share_position(engine, scheduler, trainer)
        try:
            trainer.fit()
        finally:
            engine.close()
    Path(a.out).write_text(json.dumps({"logged": writer.logged, "healed": engine.healed}))


if __name__ == "__main__":
    main()
