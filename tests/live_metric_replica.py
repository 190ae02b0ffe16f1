"""One replica group of a live run, for tests/distributed/test_live_metrics.py: a model with
BatchNorm trained with LiveEngine for ``--eval-at`` steps on its own data, then, with that step's
reduction in flight, one evaluation by the trainer (``Trainer._evaluate``: the buffers and the
recent losses averaged over the quorum's groups, its share of the test set scored, the shares
summed), then ``flush``. Writes ``<out>`` (JSON: the evaluation, its own mean loss before it,
whether the flush applied the update) and ``<out>.pt`` (the weights and buffers it
evaluated, for a single-process reference, and its own buffers before the average).
``--die``: ``average``, it sends its share of the reduction in flight and SIGKILLs itself where
its peers average; ``score``, it takes part in the average and SIGKILLs itself after scoring its
share, where its peers sum the shares."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live_replica import batch, make_model, make_optimizer, replica_arguments  # noqa: E402
from pipesgd.data.loader import EvalLoader, ShardedLoader  # noqa: E402
from pipesgd.data.split import Split  # noqa: E402
from pipesgd.live.engine import LiveEngine  # noqa: E402
from pipesgd.live.options import LiveOptions  # noqa: E402
from pipesgd.trainer import Trainer  # noqa: E402

TIMEOUT_S = 10.0  # the live timeout: a peer that stops answering fails a collective within it
TEST_SAMPLES = 203  # shares of 101 and 102 samples, batches of 16 (a short last one in each)


def eval_split() -> Split:
    """The test set every group scores (8 features: 1 x 2 x 4 pixels), the same in every process."""
    g = torch.Generator().manual_seed(7)
    return Split(torch.randint(0, 256, (TEST_SAMPLES, 1, 2, 4), generator=g, dtype=torch.uint8),
                 torch.randint(0, 4, (TEST_SAMPLES,), generator=g))


def make_eval_model() -> torch.nn.Module:
    """tests/live_replica.py's model (BatchNorm inside) behind a flatten, seeded alike on every group."""
    return torch.nn.Sequential(torch.nn.Flatten(), make_model(0))


class _NullWriter:
    def scalars(self, *args, **kwargs):
        pass


def main() -> None:
    p = replica_arguments()
    p.add_argument("--eval-at", type=int, default=4)
    p.add_argument("--die", choices=("average", "score"))
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[replica {a.replica}] %(name)s %(message)s")
    torch.set_num_threads(1)
    model = make_eval_model()
    optimizer, _ = make_optimizer(model)
    engine = LiveEngine(model, optimizer, LiveOptions(a.lighthouse, a.run_id, a.replica, timeout_s=TIMEOUT_S,
                                                      quorum_timeout_s=20, init_sync=False))
    train = ShardedLoader(eval_split(), 16, 0, 1, seed=0)  # only its length is read: no fit() here
    trainer = Trainer(model, engine, optimizer, None, train, EvalLoader(eval_split(), 16, 0, 1), _NullWriter(),
                      epochs=1, max_steps=None, log_every=100, device=torch.device("cpu"), is_main=False)
    try:
        losses = []
        for _ in range(a.eval_at):
            x, y = batch(a.replica, engine.steps)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            engine.step()
        trainer.last_losses = losses
        if a.die == "average":  # its share of the reduction in flight sent, it dies where its peers average
            engine.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if a.die == "score":  # it dies after scoring its share, where its peers sum the shares
            score = trainer._score
            trainer._score = lambda loader: (score(loader), os.kill(os.getpid(), signal.SIGKILL))[0]
        own = {k: b.clone() for k, b in model.named_buffers() if b.is_floating_point()}
        result = trainer._evaluate(0.0, time.perf_counter())
        torch.save({"evaluated": {k: v.clone() for k, v in model.state_dict().items()}, "own_buffers": own},
                   f"{a.out}.pt")
        stats = engine.flush()
        Path(a.out).write_text(json.dumps({**result, "own_loss": sum(losses) / len(losses),
                                           "applied": stats.applied, "skipped": stats.skipped}))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
