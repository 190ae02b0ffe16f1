"""The timeline report's arithmetic on hand-made spans: overlap statistics clipped to a window, and
the default window past the warm-up and the pipeline fill (tests/lab/test_observability.py reads
real traces)."""

from __future__ import annotations

import pytest

from pipesgd_lab.report import ReportError


@pytest.mark.timeout(60)
def test_overlap_stats_clip_to_the_window():
    from pipesgd_lab.report.timeline import Span, Trace, overlap_stats

    spans = [Span(0, 1, "reduce-scatter", "comm", 0.0, 8.0, None),   # 6 ms inside [2, 12]
             Span(0, 1, "decode+add", "compress", 8.0, 10.0, None),  # 2 ms
             Span(1, 1, "allgather", "comm", 11.0, 20.0, None),      # 1 ms
             Span(0, 0, "wait", "wait", 9.0, 10.0, 5),               # 1 ms
             Span(1, 0, "wait", "wait", 1.0, 3.0, 5),                # 1 ms
             Span(0, 0, "forward", "compute", 2.0, 9.0, 6)]          # not communication
    stats = overlap_stats(Trace(spans, {}, {}), 2.0, 12.0)
    assert stats == pytest.approx({"comm_busy_ms": 9.0, "waited_ms": 2.0, "hidden_fraction": 7 / 9})
    assert overlap_stats(Trace(spans[3:], {}, {}), 2.0, 12.0)["hidden_fraction"] == 0.0


@pytest.mark.timeout(60)
def test_default_window_skips_the_warm_up_and_fill():
    from pipesgd_lab.report.timeline import Span, Trace, pick_steps

    spans = [Span(0, 0, "forward", "compute", float(s), s + 0.5, s) for s in range(20)]
    assert pick_steps(Trace(spans, {}, {"width": 2, "warmup_sync_steps": 10}), 4) == [13, 14, 15, 16]
    assert pick_steps(Trace(spans, {}, {}), 4) == [8, 9, 10, 11]
    assert pick_steps(Trace(spans, {}, {"width": 2, "warmup_sync_steps": 50}), 4) == [8, 9, 10, 11]
    with pytest.raises(ReportError, match="step 30 is not in the trace; traced steps are 0..19"):
        pick_steps(Trace(spans, {}, {}), 4, first=30)


def _step(rank, step, t0, fwd, bwd):
    from pipesgd_lab.report.timeline import Span
    return [Span(rank, 0, "forward", "compute", t0, t0 + fwd, step), Span(rank, 0, "backward", "compute", t0 + fwd,
                                                                          t0 + fwd + bwd, step)]


@pytest.mark.timeout(60)
def test_the_cores_account_splits_compute_by_what_ran_under_it_and_names_the_backends_share():
    from pipesgd_lab.report.cores import core_cost, table
    from pipesgd_lab.report.timeline import Span, Trace

    spans = []
    for step in range(8):  # steps 0..7 of 100 ms each; 4..7 run 30 ms slower with the ring under them
        slow = 30.0 if step >= 4 else 0.0
        spans += _step(0, step, step * 200.0, 40.0, 60.0 + slow)
        spans.append(Span(0, 0, "update", "update", step * 200.0 + 150.0, step * 200.0 + 155.0, step))
    spans += [Span(0, 1, "encode", "compress", 795.0, 805.0, None),         # 5 ms under step 4's forward
              Span(0, 1, "reduce-scatter", "comm", 805.0, 1200.0, None),    # all of step 4's and 5's
              Span(0, 1, "decode+add", "compress", 1200.0, 1204.0, None),   # 4 ms under step 6's forward
              Span(0, 1, "allgather", "comm", 1204.0, 1600.0, None),        # step 6 and 7
              Span(0, 1, "average", "comm", 1600.0, 1602.0, None)]
    [row] = core_cost(Trace(spans, {}, {"width": 2}), skip=0)
    assert (row["steps_under"], row["steps_alone"]) == (4, 4)
    assert row["compute_under_ms"] == 130.0 and row["compute_alone_ms"] == 100.0 and row["gap_ms"] == 30.0
    # the engine's own spans under those steps: 5 under step 4, 4 under step 6, none under 5 and 7
    assert row["engine_beside_ms_per_step_under"] == pytest.approx(2.0)
    assert row["backend_ms_per_step_under"] == pytest.approx(28.0)
    assert row["engine_inline_ms_per_step"] == {"update": 5.0}
    assert "| 0 | 4 / 4 | 130.0 | 100.0 | 30.0 | 2.0 | 28.0 | update 5.0 |" in table([row])
    # the default skip is the pipeline's fill plus one: steps 0 and 1 left out
    assert core_cost(Trace(spans, {}, {"width": 2}))[0]["steps_alone"] == 2
    quiet = [s for s in spans if s.tid == 0]
    with pytest.raises(ReportError, match="no traced step ran with the exchange on the wire under it"):
        core_cost(Trace(quiet, {}, {}))


@pytest.mark.timeout(60)
def test_the_cores_command_prints_the_table_and_writes_its_json(tmp_path, capsys):
    import json

    from pipesgd_lab.report.__main__ import main

    events = [{"ph": "X", "name": n, "cat": c, "pid": 0, "tid": tid, "ts": t * 1e3, "dur": d * 1e3, "args": {"step": s}}
              for n, c, tid, t, d, s in (("forward", "compute", 0, 0, 100, 3), ("forward", "compute", 0, 200, 150, 4),
                                         ("allgather", "comm", 1, 190, 200, -1))]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events, "otherData": {}}))
    assert main(["cores", str(tmp_path), "--skip", "0"]) == 0
    assert "| 0 | 1 / 1 | 150.0 | 100.0 | 50.0 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "cores.json").read_text())[0]["gap_ms"] == 50.0
    assert main(["cores", str(tmp_path / "nonesuch")]) == 2
