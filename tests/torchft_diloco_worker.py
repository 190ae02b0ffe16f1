"""One replica group of tests/distributed/test_torchft_diloco.py: torchft's DiLoCo (TorchftDiLoCo)
around the engine reference's model, fed the reference's batches, behind the test's lighthouse."""

from __future__ import annotations

import torch

from diloco_reference import INNER, OUTER
from engine_reference import flat_params, loss_of, make_model


def train(replica: int, lighthouse: str, sync_every: int, fragments: int, delay: int, steps: int, out) -> None:
    """Train ``steps`` inner steps as replica group ``replica``; put (replica, global weights, local
    weights, bytes sent per step) on the queue ``out``."""
    torch.set_num_threads(1)
    from pipesgd.live.diloco import TorchftDiLoCo
    from pipesgd.live.options import LiveOptions

    model = make_model()
    opt = INNER(model.parameters())
    options = LiveOptions(lighthouse, "torchft-diloco-test", replica, init_sync=False, timeout_s=60)
    engine = TorchftDiLoCo(model, opt, options, sync_every, fragments=fragments, sync_delay=delay, outer_optimizer=OUTER)
    sent = []
    try:
        for t in range(steps):
            opt.zero_grad()
            loss_of(model, replica, t).backward()
            stats = engine.step()
            assert stats.applied
            sent.append(stats.comm.wire_bytes)
        out.put((replica, engine.consistent_params().clone(), flat_params(model), sent, engine.summary()))
    finally:
        engine.close()
