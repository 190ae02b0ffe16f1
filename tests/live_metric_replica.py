"""One replica group of a live run, for tests/distributed/test_live_metrics.py: the model of
tests/live_replica.py (BatchNorm inside) trained with LiveEngine for ``--metric-at`` steps; then,
with that step's reduction in flight, the loop's evaluation average (``engine.peers().average``
over the BatchNorm buffers and a loss, as Trainer._evaluate calls it); then ``flush``. Writes one
JSON object to ``--out``: its own values before the average, the values after, the count of
groups averaged, the seconds the average took and whether the flush applied the update.
``--die-in-metric``: it waits for the reduction in flight and SIGKILLs itself instead of averaging."""

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
from pipesgd.engine.live import LiveEngine  # noqa: E402
from pipesgd.live.options import LiveOptions  # noqa: E402

TIMEOUT_S = 10.0  # the live timeout: a peer that stops answering fails the average within it


def main() -> None:
    p = replica_arguments()
    p.add_argument("--metric-at", type=int, default=4)
    p.add_argument("--die-in-metric", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[replica {a.replica}] %(name)s %(message)s")
    torch.set_num_threads(1)
    model = make_model(0)
    optimizer, _ = make_optimizer(model)
    engine = LiveEngine(model, optimizer, LiveOptions(a.lighthouse, a.run_id, a.replica, timeout_s=TIMEOUT_S,
                                                      quorum_timeout_s=20, init_sync=False))
    try:
        loss = torch.zeros(())
        for _ in range(a.metric_at):
            x, y = batch(a.replica, engine.steps)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            engine.step()
        if a.die_in_metric:  # its share of the reduction in flight sent, it dies where its peer averages
            engine.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        values = [b for b in model.buffers() if b.is_floating_point()]
        values.append(loss.detach().double().reshape(1))
        own = [v.tolist() for v in values]
        t0 = time.perf_counter()
        count = engine.peers().average(values, "the test's average")
        seconds = time.perf_counter() - t0
        stats = engine.flush()
        Path(a.out).write_text(json.dumps({"own": own, "averaged": [v.tolist() for v in values], "count": count,
                                           "seconds": seconds, "applied": stats.applied,
                                           "skipped": stats.skipped}))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
