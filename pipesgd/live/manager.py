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

    store: Any  # torch.distributed.TCPStore
    transport: Any  # pipesgd.live.transport.RunTransport
    group: TorchftGroup
    manager: Any  # torchft.manager.Manager


def start(options: LiveOptions, load: Callable[[dict], None], save: Callable[[], dict], *,
          async_quorum: bool) -> Torchft:
    """This replica group's Manager (one process: rank 0 of a world of 1), reaching the run's
    lighthouse, that hands a healer ``save()`` and loads a donor's state with ``load(state)``
    (registered as ``"pipesgd"``). ``async_quorum``: the quorum is formed on torchft's thread while
    the step goes on (``live``: it overlaps the next forward) or within ``start_quorum``. Call
    :func:`pipesgd.live.require_torchft` first: this imports torchft."""
    quiet_torchft()
    from torchft.process_group import ProcessGroupGloo

    from .transport import RunTransport

    timeout = timedelta(seconds=options.timeout_s)
    store = listen.store_master(options.host, timeout)  # listening before its Manager looks for it
    transport = RunTransport(options.run_id, options.host, timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = listen.manager(
        options.host, pg=pg, load_state_dict=None, state_dict=None,
        min_replica_size=options.min_replicas, use_async_quorum=async_quorum, timeout=timeout,
        quorum_timeout=timedelta(seconds=options.quorum_timeout_s), connect_timeout=timeout, rank=0,
        world_size=1, store_addr=options.host, store_port=store.port, lighthouse_addr=options.lighthouse,
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
