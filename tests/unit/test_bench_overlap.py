"""The overlap benchmark's arithmetic (pipesgd_lab/bench/overlap.py); tests/gpu runs the benchmark."""

import pytest

from pipesgd_lab.bench.overlap import summarize


def test_overlap_is_the_hidden_share_of_the_shorter_phase_on_the_slowest_rank():
    fast = {"compute": [10.0, 10.0, 12.0], "comm": [4.0, 4.0, 4.0], "both": [11.0, 11.0, 11.0]}
    slow = {"compute": [20.0, 20.0, 20.0], "comm": [5.0, 5.0, 5.0], "both": [21.0, 22.0, 21.0]}
    result = summarize([fast, slow])
    assert result["median_ms"] == {"compute": 20.0, "comm": 5.0, "both": 21.0}
    assert result["overlap"] == pytest.approx((20 + 5 - 21) / 5)
    assert result["spread_ms"]["both"] == [11.0, 22.0]


def test_serial_phases_overlap_nothing():
    t = {"compute": [10.0], "comm": [5.0], "both": [15.0]}
    assert summarize([t, t])["overlap"] == 0.0
