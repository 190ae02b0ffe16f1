"""What a worker says when its job is stopped from outside (scancel, a time limit, preemption, a
launcher shutting the job down): SIGTERM, SIGKILL after a grace period.

A Python signal handler runs only between bytecodes of the main thread, and a rank blocked in a
collective sits in C++ until the backend's timeout, after the SIGKILL. So the C-level handler's
wakeup byte (``signal.set_wakeup_fd``) wakes a thread that logs the message and ends the process
at once with 128 + signum: as abrupt as the signal's default action, so a resume from the newest
checkpoint is the same as after a SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def reported(describe: Callable[[signal.Signals], str],
             signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """While the block runs, any of ``signals`` makes this process log ``describe(sig)`` as an
    error and exit with status 128 + sig at once, even while the main thread is blocked in C++.
    Outside the main thread (where handlers cannot be installed) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    wanted = {int(s) for s in signals}

    def watch() -> None:
        while data := receiver.recv(1):  # b"" once the block has ended and `sender` is closed
            if data[0] not in wanted:
                continue  # another signal with a Python handler (SIGINT): its handler runs as usual
            sig = signal.Signals(data[0])
            try:
                log.error("%s", describe(sig))
                for h in logging.getLogger().handlers:
                    h.flush()
            finally:
                os._exit(128 + sig)

    previous_fd = signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    # A Python-level handler, so that the C handler writes the wakeup byte; it has nothing to do.
    previous = {s: signal.signal(s, lambda signum, frame: None) for s in signals}
    thread = threading.Thread(target=watch, name="pipesgd-termination", daemon=True)
    thread.start()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        sender.close()
        thread.join(timeout=5.0)
        receiver.close()
