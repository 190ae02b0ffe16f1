"""dist.cpu_affinity: which core a worker is pinned to, and that every thread of it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pipesgd.placement import PINNABLE, core_for, pin

linux = pytest.mark.skipif(not PINNABLE, reason="os.sched_setaffinity is Linux-only")


@pytest.mark.parametrize("rule,rank,local_rank,allowed,core", [
    ("rank", 0, 0, [0, 1], 0),
    ("rank", 1, 0, [0, 1], 1),   # the emulated cluster: every node's one worker has LOCAL_RANK 0
    ("rank", 3, 0, [0, 1], 1),   # more ranks than cores: round robin
    ("local_rank", 5, 1, [0, 1], 1),
    ("rank", 1, 0, [6, 2, 4], 4),  # the allowed cores in order, not their numbers
])
def test_a_worker_gets_the_rank_th_allowed_core(rule, rank, local_rank, allowed, core):
    assert core_for(rule, rank, local_rank, allowed) == core


def test_an_unknown_rule_names_the_option_and_the_choices():
    with pytest.raises(ValueError, match=r"dist.cpu_affinity='cores' is not known; allowed: null, rank, local_rank"):
        pin("cores", 0, 0)


@linux
def test_null_leaves_the_placement_to_the_os():
    before = os.sched_getaffinity(0)
    placement = pin(None, 1, 1)
    assert placement == {"rule": None, "allowed": sorted(before), "core": None}
    assert os.sched_getaffinity(0) == before


@linux
def test_every_thread_of_the_process_is_pinned_even_one_started_before():
    """In a child process (pinning is for the process's life): a thread already running when
    pin() is called (as torch's may be) ends up on the core too, and so does one started after."""
    allowed = sorted(os.sched_getaffinity(0))
    code = textwrap.dedent("""
        import os, threading, json
        from pipesgd.placement import pin
        go, seen = threading.Event(), {}
        def early():
            go.wait(30)
            seen["early"] = sorted(os.sched_getaffinity(0))
        t = threading.Thread(target=early); t.start()
        placement = pin("rank", 1, 0)
        go.set(); t.join()
        late = threading.Thread(target=lambda: seen.__setitem__("late", sorted(os.sched_getaffinity(0))))
        late.start(); late.join()
        print(json.dumps({"placement": placement, "main": sorted(os.sched_getaffinity(0)), **seen}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    core = allowed[1 % len(allowed)]
    assert got["placement"] == {"rule": "rank", "allowed": allowed, "core": core}
    assert got["main"] == got["early"] == got["late"] == [core]
