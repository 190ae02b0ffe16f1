"""pipesgd.reliability.termination: a SIGTERM while the main thread is blocked in a C call (as a rank blocked in
a collective is) ends the process at once with 128 + 15 and the caller's message; outside the block
the previous handler is back. The hang fault (PIPESGD_FAULT=hang:R:S) waits for exactly that."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pipesgd.reliability.faults import Fault, Faults, parse

CHILD = """
import signal, socket, sys
from pipesgd.reliability.termination import reported
a, b = socket.socketpair()
with reported(lambda sig: f"stopped by {sig.name} while blocked"):
    print("ready", flush=True)
    a.recv(1) if sys.argv[1] == "inside" else None   # blocked in C, retried after a Python handler (PEP 475)
print("after", flush=True)
a.recv(1)
"""


def start(where: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, where], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.timeout(60)
def test_sigterm_while_blocked_in_c_exits_143_with_the_message():
    proc = start("inside")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM while blocked" in err


@pytest.mark.timeout(60)
def test_outside_the_block_sigterm_has_its_default_action_again():
    proc = start("outside")
    assert proc.stdout.readline() == "after\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and "stopped by" not in err


@pytest.mark.timeout(60)
def test_hang_fault_waits_for_a_signal():
    assert [(f.kind, f.rank, f.step) for f in parse("hang:1:35")] == [("hang", 1, 35)]
    code = ("import sys; from pipesgd.reliability.faults import Fault, Faults; print('ready', flush=True); "
            "Faults([Fault('hang', 0, 3)], rank=0).after_backward(3, None)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=2)  # still waiting: the fault holds the rank (2 s is a lower bound, not a sync)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and "does 'hang' at step 3" in err
    assert Faults([Fault("hang", 0, 3)], rank=0, attempt=1).mine == [], "first attempt only, as every fault"
