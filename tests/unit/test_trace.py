"""The span recorder on its own: disjoint spans per thread, the step limit, trace-event output,
and a null tracer that allocates nothing (the "tracing off costs nothing" half that can be
checked without a clock)."""

import sys
import threading

import pytest
from hydra import compose, initialize_config_dir
from runs import ROOT

from pipesgd.observability import trace
from pipesgd.config import ConfigError, validate


def _work(tracer, name, cat, n, step=-1):
    for i in range(n):
        with tracer.span(name, cat, step=step if step >= 0 else -1, hop=i):
            sum(range(200))


@pytest.mark.timeout(30)
def test_null_tracer_allocates_nothing():
    tr = trace.NULL_TRACER
    assert trace.current() is tr and not tr.enabled
    assert tr.span("encode", "compress", hop=1) is tr.span("wait", "wait", 7), "one shared object, none per span"
    for _ in range(1000):  # warm any lazily created caches
        with tr.span("encode", "compress", hop=3):
            pass
    before = sys.getallocatedblocks()
    for i in range(100_000):
        with tr.span("encode", "compress", hop=i):
            pass
    # A single allocation per span would show as ~100k blocks; allow interpreter noise.
    assert sys.getallocatedblocks() - before < 100


@pytest.mark.timeout(30)
def test_spans_of_two_threads_are_separate_tracks_and_disjoint():
    tr = trace.Tracer(rank=3)
    other = threading.Thread(target=_work, args=(tr, "allgather", "comm", 50), name="pipesgd-comm_0")
    other.start()
    _work(tr, "forward", "compute", 50, step=0)
    other.join()
    part = tr.part()
    assert part.threads == {0: "main", 1: "pipesgd-comm_0"}
    for tid, name in ((0, "forward"), (1, "allgather")):
        spans = sorted(s for s in part.spans if s[0] == tid)
        assert len(spans) == 50 and {s[1] for s in spans} == {name}
        assert all(a[4] <= b[3] for a, b in zip(spans, spans[1:])), "spans on one thread overlap"
        assert all(s[3] <= s[4] for s in spans)


@pytest.mark.timeout(30)
def test_recording_stops_at_max_steps():
    tr = trace.Tracer(rank=0, max_steps=2)
    for step in range(4):
        with tr.span("forward", "compute", step):
            pass
        with tr.span("allgather", "comm"):  # no step: recorded only while recording is on
            pass
    assert [s[5] for s in tr.part().spans if s[1] == "forward"] == [0, 1]
    assert len([s for s in tr.part().spans if s[1] == "allgather"]) == 2
    with pytest.raises(ValueError, match="trainer.trace_steps must be an integer >= 1 or null, got 0"):
        trace.Tracer(rank=0, max_steps=0)


@pytest.mark.timeout(30)
def test_chrome_trace_merges_ranks_from_a_common_origin():
    parts = [trace.TracePart(1, {0: "main"}, [(0, "forward", "compute", 5_000, 7_500, 4, -1)]),
             trace.TracePart(0, {0: "main", 1: "pipesgd-comm_0"},
                             [(0, "forward", "compute", 2_000, 3_000, 4, -1),
                              (1, "reduce-scatter", "comm", 2_500, 9_001, -1, 0)])]
    doc = trace.chrome_trace(parts, {"mode": "pipe"})
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        (0, 0, 0.0, 1.0), (0, 1, 0.5, 6.501), (1, 0, 3.0, 2.5)]
    assert spans[0]["args"] == {"step": 4} and spans[1]["args"] == {"hop": 0}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, 0): "main", (0, 1): "pipesgd-comm_0", (1, 0): "main"}
    assert doc["otherData"] == {"origin_unix_ns": 2_000, "mode": "pipe"}


@pytest.mark.timeout(30)
def test_install_switches_every_caller():
    tr = trace.Tracer(rank=0)
    trace.install(tr)
    try:
        with trace.current().span("wait", "wait", 0):
            pass
    finally:
        trace.install(trace.NULL_TRACER)
    assert [s[1] for s in tr.part().spans] == ["wait"]
    assert trace.current() is trace.NULL_TRACER


@pytest.mark.timeout(60)
def test_trace_settings_are_checked_before_workers_start():
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["trainer.trace_steps=0"])
        with pytest.raises(ConfigError, match="trainer.trace_steps=0 is invalid: must be an integer >= 1"):
            validate(cfg)
        with pytest.raises(Exception) as err:  # the schema types trainer.trace (pipesgd/schema.py)
            compose("config", overrides=["trainer.trace=sometimes"])
    assert "Value 'sometimes' is not a valid bool" in str(err.value.__cause__)
