"""A replica group's torchft Manager, set up in one place for both live modes (``live``'s
:class:`~pipesgd.live.engine.LiveEngine`, ``torchft_diloco``'s
:class:`~pipesgd.live.diloco.TorchftDiLoCo`): its store, its run-checked state transfer, its Gloo
group, the Manager listening on the run's address (:mod:`pipesgd.live.listen`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from . import listen
from .group import TorchftGroup
from .options import LiveOptions


class Torchft(NamedTuple):
    """What an engine keeps of its set-up: the store and the transport it shuts down with the
    Manager (``transport.refused`` counts strangers turned away), the group its reductions run over."""

    store: Any  # torch.distributed.TCPStore (None on a group's ranks other than 0: they are its clients)
    transport: Any  # pipesgd.live.transport.RunTransport
    group: TorchftGroup
    manager: Any  # torchft.manager.Manager


def start(options: LiveOptions, load: Callable[[dict], None], save: Callable[[], dict], *,
          async_quorum: bool) -> Torchft:
    """This process's Manager in its replica group, reaching the run's lighthouse, that hands a
    healer ``save()`` and loads a donor's state with ``load(state)`` (registered as ``"pipesgd"``).
    A group is one process (rank 0 of a world of 1), or under torchrun a job of k ranks
    (``trainer.mode=torchft_diloco``): each rank its Manager at its rank in the job, the group's
    store and Manager server on its rank 0 (the store's port sent to the others over the job's
    process group, so call it on every rank of the job together); rank j of every group then
    reduces with rank j of the others (torchft's own layout). ``async_quorum``: the quorum is formed
    on torchft's thread while the step goes on (``live``: it overlaps the next forward) or within
    ``start_quorum``. Call :func:`pipesgd.live.require_torchft` first: this imports torchft."""
    quiet_torchft()
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from .transport import RunTransport

    timeout = timedelta(seconds=options.timeout_s)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    # the group's store, listening before its Manager looks for it; the other ranks are its clients
    store = listen.store_master(options.host, timeout) if rank == 0 else None
    port = [store.port if store is not None else None]
    if world > 1:
        dist.broadcast_object_list(port, src=0)
    transport = RunTransport(options.run_id, options.host, timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = listen.manager(
        options.host, pg=pg, load_state_dict=None, state_dict=None,
        min_replica_size=options.min_replicas, use_async_quorum=async_quorum, timeout=timeout,
        quorum_timeout=timedelta(seconds=options.quorum_timeout_s), connect_timeout=timeout, rank=rank,
        world_size=world, store_addr=options.host, store_port=port[0], lighthouse_addr=options.lighthouse,
        replica_id=f"{options.run_id}_{options.replica}", hostname=listen.bracketed(options.host),
        checkpoint_transport=transport, init_sync=options.init_sync)
    manager.register_state_dict_fn("pipesgd", load, save)
    return Torchft(store, transport, TorchftGroup(pg), manager)


def quiet_torchft() -> None:
    """torchft logs every quorum and every vote at INFO (thousands of lines a run); the live
    engines log what matters (skipped updates, heals). A level the caller set is kept."""
    for name in ("torchft", "torchft_commits", "torchft_quorums"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
