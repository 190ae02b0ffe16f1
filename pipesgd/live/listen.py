"""Where a live run's servers listen: on the run's address (``trainer.live.host``) only, never on
every interface. Two of them would not by themselves: torch's ``TCPStore`` master binds every
interface, and torchft 0.2.0's ``Manager`` binds its server to ``[::]`` (hard-coded in
``torchft/manager.py``). docs/reliability.md, "Live recovery", lists what listens where.
"""

from __future__ import annotations

import re
import socket
import threading
from datetime import timedelta
from importlib.metadata import version

from . import TORCHFT_VERSION

WILDCARD_BIND = re.compile(r"\[::\]:(\d+)")  # what torchft 0.2.0's Manager hands its ManagerServer
_swapping = threading.Lock()  # one Manager construction at a time sees the wrapped ManagerServer


def bracketed(host: str) -> str:
    """``host`` as it goes before ``:port`` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def store_master(host: str, timeout: timedelta = timedelta(seconds=300)):
    """A ``torch.distributed.TCPStore`` master listening on ``host`` only, at a free port (its
    ``port``). The master binds every interface when it opens its own socket; handed one already
    bound (``master_listen_fd``, a documented argument) it listens there. The store owns and
    closes that socket."""
    import torch.distributed as dist

    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server(address, family=family)
    port = sock.getsockname()[1]
    fd = sock.detach()  # from here the store's: closed by it, not by this socket object's finalizer
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd)


def manager(host: str, **kwargs):
    """``torchft.manager.Manager(**kwargs)`` whose server (group rank 0 starts one) listens on
    ``host`` instead of ``[::]``. torchft 0.2.0 has no argument or variable for that address, so
    for the construction only, ``torchft.manager.ManagerServer`` is a wrapper that rewrites the
    ``bind`` it is given (the port is kept). RuntimeError, never a server on every interface,
    where torchft's code no longer has that shape: the bind is not ``[::]:<port>``, or rank 0
    built its Manager without calling ``ManagerServer``."""
    import torchft.manager as tm

    server, binds = tm.ManagerServer, []

    def bound_server(*args, **kw):
        bind = kw.get("bind")
        match = WILDCARD_BIND.fullmatch(bind) if isinstance(bind, str) else None
        if match is None:
            raise RuntimeError(_changed(f"its Manager handed ManagerServer bind={bind!r}, not '[::]:<port>'"))
        binds.append(bind)
        return server(*args, **{**kw, "bind": f"{bracketed(host)}:{match.group(1)}"})

    with _swapping:
        tm.ManagerServer = bound_server
        try:
            built = tm.Manager(**kwargs)
        finally:
            tm.ManagerServer = server
    if kwargs.get("rank") == 0 and len(binds) != 1:
        built.shutdown(wait=False)
        raise RuntimeError(_changed(f"its Manager at rank 0 called ManagerServer {len(binds)} times, not once"))
    return built


def _changed(what: str) -> str:
    return (f"torchft {version('torchft')} is not shaped as pipesgd expects ({what}), so the live mode cannot make "
            f"the Manager's server listen on the run's address only; install torchft=={TORCHFT_VERSION} "
            "(pip install 'pipesgd[live]')")
