"""The heartbeat thread ends with close(), also when the job's store host has just gone.

A daemon thread still inside a TCPStore call when the interpreter finalizes is ended by
``pthread_exit`` while C++ frames are on its stack, and the process aborts (SIGABRT) after its
work is done: a worker of a finished run then reports a failure. That happened to rank 1 when
rank 0, the store's host, exited first and rank 1's heartbeat was reconnecting."""

import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipesgd.reliability.watchdog import BEAT_TIMEOUT_S, CLOSE_WAIT_FACTOR, Watchdog

# rank 1's view of the end of a job: its heartbeat reached the store, then the store's host
# (rank 0) exited, then this rank finished and closed its watchdog and exited
STORE_GONE_THEN_EXIT = textwrap.dedent("""
    import threading
    from datetime import timedelta
    import torch.distributed as dist
    from pipesgd.reliability.watchdog import Watchdog
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    dog = Watchdog(1, 2, timeout_s=300.0, store_addr=("127.0.0.1", host.port)).start()
    host.wait(["pipesgd/heartbeat/0/1"])  # the first beat landed
    del host                              # the store's host is gone
    dog.set("eval", 2)                    # the next beat fails and the client reconnects to a closed port
    dog.close()
    print("alive:", [t.name for t in threading.enumerate() if t.name == "pipesgd-heartbeat"])
""")


def _store_host() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _heartbeat_alive() -> bool:
    return any(t.name == "pipesgd-heartbeat" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_close_joins_the_heartbeat_after_the_store_host_went_away():
    host = _store_host()
    dog = Watchdog(1, 2, timeout_s=300.0, store_addr=("127.0.0.1", host.port)).start()
    host.wait(["pipesgd/heartbeat/0/1"])
    assert host.get("pipesgd/heartbeat/0/1").decode().startswith("0|")
    del host
    dog.set("eval", 2)
    dog.close()  # waits for the reconnect to give up: the beat's timeout, not the job's 300 s
    assert not _heartbeat_alive()


@pytest.mark.timeout(60)
def test_close_returns_at_once_between_beats():
    host = _store_host()
    dog = Watchdog(1, 2, timeout_s=300.0, store_addr=("127.0.0.1", host.port)).start()
    host.wait(["pipesgd/heartbeat/0/1"])
    dog.close()
    assert not _heartbeat_alive()
    dog.set("compute", 7)
    assert host.delete_key("pipesgd/heartbeat/0/1")
    dog.start()  # a closed watchdog starts again (a second fit)
    host.wait(["pipesgd/heartbeat/0/1"])
    assert host.get("pipesgd/heartbeat/0/1").decode().startswith("7|")
    dog.close()
    assert not _heartbeat_alive()


@pytest.mark.timeout(90)
def test_a_process_exiting_after_its_store_host_does_not_abort():
    r = subprocess.run([sys.executable, "-c", STORE_GONE_THEN_EXIT], capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "alive: []" in r.stdout


def test_the_heartbeat_waits_are_bounded():
    assert Watchdog(0, 2, timeout_s=300.0)._beat_timeout_s() == BEAT_TIMEOUT_S
    assert Watchdog(0, 2, timeout_s=0.5)._beat_timeout_s() == 1.0
    assert BEAT_TIMEOUT_S * CLOSE_WAIT_FACTOR < 10.0  # a finished rank exits within seconds
