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
