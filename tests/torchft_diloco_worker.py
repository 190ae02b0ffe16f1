"""One replica group of tests/distributed/test_torchft_diloco.py: torchft's DiLoCo (TorchftDiLoCo)
around the engine reference's model, fed the reference's batches, behind the test's lighthouse."""

from __future__ import annotations

import torch

from diloco_reference import INNER, OUTER
from engine_reference import flat_params, loss_of, make_model


def by_value(t: torch.Tensor):
    """A tensor as a numpy copy, for the results queue: a tensor put there travels as a file
    descriptor its process shares until it exits, so a worker that finished before the parent read
    its result left the parent a dead socket (FileNotFoundError in resource_sharer). ``gather``
    turns it back."""
    return t.detach().numpy().copy()


def gather(targets: list[tuple], timeout_s: float = 150.0) -> list[tuple]:
    """Run each ``(fn, *args)`` of ``targets`` in a spawned process of its own, ``fn(*args, out)``;
    what each put on ``out``, in the order they arrived, numpy arrays (``by_value``) back as
    tensors. Every process is joined (or killed) and must exit 0."""
    import numpy as np

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out)) for fn, *args in targets]
    for p in procs:
        p.start()
    try:
        results = [tuple(torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in out.get(timeout=timeout_s))
                   for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


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
        out.put((replica, by_value(engine.consistent_params()), by_value(flat_params(model)), sent, engine.summary()))
    finally:
        engine.close()


def train_in_group(replica: int, rank: int, ranks: int, port: int, lighthouse: str, sync_every: int, steps: int,
                   out) -> None:
    """Rank ``rank`` of replica group ``replica``, a job of ``ranks`` processes (its own Gloo group at
    ``port``, rank 0 hosting its store): each rank takes its ``ranks``-th of the group's reference
    batch, so the group's averaged gradient is the one rank's of the whole batch. Puts (replica,
    rank, global weights, local weights, bytes sent per step, summary) on ``out``."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    from engine_reference import batch

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from pipesgd.live.diloco import TorchftDiLoCo
    from pipesgd.live.options import LiveOptions

    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=60))
    model = make_model()
    opt = INNER(model.parameters())
    options = LiveOptions(lighthouse, "torchft-groups-test", replica, init_sync=False, timeout_s=60)
    engine = TorchftDiLoCo(model, opt, options, sync_every, outer_optimizer=OUTER)
    sent = []
    try:
        for t in range(steps):
            opt.zero_grad()
            x, y = batch(replica, t)
            part = slice(rank * len(y) // ranks, (rank + 1) * len(y) // ranks)
            nn.functional.cross_entropy(model(x[part]), y[part]).backward()
            stats = engine.step()
            sent.append(stats.comm.wire_bytes)
        out.put((replica, rank, by_value(engine.consistent_params()), by_value(flat_params(model)), sent,
                 engine.summary()))
    finally:
        engine.close()
        dist.destroy_process_group()
