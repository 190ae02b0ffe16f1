"""The SLURM tier's log check: a job log's tracebacks fail a test, except the one torchrun's exit
barrier logs when the store's host agent exits first (pytorch/pytorch#69520), which costs nothing.
The log lines are those of a real two-node job (CI, 2026-11-29) that completed with exit code 0."""

from __future__ import annotations

from slurm_jobs import tracebacks

SITE = "torch/distributed/elastic/agent/server/api.py:1008]"
EXIT_BARRIER = f"""\
[2026-11-29 00:01:15,101][pipesgd.train][INFO] - done: 40 steps
E1129 00:01:15.812000 20757 {SITE} Error waiting on exit barrier. Elapsed: 0.41 seconds
E1129 00:01:15.812000 20757 {SITE} Traceback (most recent call last):
E1129 00:01:15.812000 20757 {SITE}   File ".../api.py", line 994, in _exit_barrier
E1129 00:01:15.812000 20757 {SITE} torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.
W1129 00:01:18.437000 20757 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node \
'node2_20757_0' has failed to shutdown the rendezvous '1' due to an error of type RendezvousConnectionError.
"""
WORKER = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "pipesgd/train.py", line 1, in <module>
[rank1]: RuntimeError: boom
"""


def test_the_exit_barrier_race_alone_is_not_a_failure():
    assert tracebacks(EXIT_BARRIER) == []


def test_any_other_traceback_is_one():
    assert tracebacks(EXIT_BARRIER + WORKER) == ["[rank1]: Traceback (most recent call last):"]
    # The same call site in another agent that logged no exit-barrier error is not excused.
    other = f"E1129 00:01:16.000000 20801 {SITE} Traceback (most recent call last):"
    assert tracebacks(EXIT_BARRIER + other) == [other]
    assert tracebacks(WORKER) == ["[rank1]: Traceback (most recent call last):"]
