"""The host-speed probe a timing run takes before and after itself, and how the study's report
reads the probes: which runs ran on a host that moved under them."""

import pytest
import torch

from pipesgd_lab.bench import probe
from pipesgd_lab.bench.tta_report import host_speed_lines


def test_the_probe_measures_and_leaves_torchs_threads_as_they_were():
    threads = torch.get_num_threads()
    got = probe.speed(0.05, threads=1)
    assert got["gflops"] > 0 and got["range"][0] <= got["gflops"] <= got["range"][1]
    assert got["threads"] == 1 and got["seconds"] == 0.05
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="seconds=0"):
        probe.speed(0)


def _row(arm: str, before: float, after: float, repeat: int = 0) -> dict:
    return {"arm": arm, "repeat": repeat, "host_speed": {"before": {"gflops": before}, "after": {"gflops": after}}}


def test_runs_the_host_moved_under_are_named_and_steady_ones_are_not():
    rows = [_row("sync", 100, 101), _row("pipe", 99, 100), _row("compute", 100, 80),  # moved during the run
            _row("ddp", 120, 121),  # steady, but 20 % faster than the others: another minute of the host
            {"arm": "old", "repeat": 0}]  # a row from before the probe: not counted
    got = probe.summary(rows)
    assert got["runs"] == 4 and got["median_gflops"] == pytest.approx(100.0) and got["range_gflops"] == [80, 121]
    assert [(m["arm"], round(m["during"], 2)) for m in got["moved"]] == [("compute", -0.2), ("ddp", 0.01)]
    assert got["moved"][1]["from_median"] == pytest.approx(0.205)
    assert probe.summary([{"arm": "old"}]) is None


def test_the_report_says_which_runs_moved():
    steady = probe.summary([_row("sync", 100, 101), _row("pipe", 100, 99)])
    moved = probe.summary([_row("sync", 100, 101), _row("pipe", 100, 70, repeat=2), _row("ddp", 100, 100)])
    lines = host_speed_lines({"links": {"100mbit": {"timing_host_speed": steady}, "50mbit": {"timing_host_speed": moved},
                                        "25mbit": {"timing_host_speed": None}}})
    assert lines[0] == ("host speed on 100mbit: median 100.0 GFLOP/s over 2 timing runs (range 99.0-101.0); "
                        "no run moved by more than 5%")
    assert lines[1].endswith("moved by more than 5% under 1: pipe r2 (100.0 -> 70.0)") and len(lines) == 2


def test_a_negative_probe_is_named(capsys):
    from pipesgd_lab.bench import tta

    with pytest.raises(SystemExit) as e:
        tta.parse(["--probe-s", "-1"])
    assert e.value.code == 2 and "argument --probe-s: must be >= 0 seconds" in capsys.readouterr().err
    assert tta.parse(["--probe-s", "0"]).probe_s == 0


def test_a_negative_probe_is_named_by_the_bench_too(capsys):
    from pipesgd_lab.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--probe-s", "-0.5", "--list"])
    assert e.value.code == 2 and "argument --probe-s: must be >= 0 seconds" in capsys.readouterr().err


def test_around_probes_before_and_after_its_block_or_not_at_all():
    with probe.around(0.02) as got:
        assert list(got) == ["before"], "the after probe waits for the block's end"
    assert sorted(got) == ["after", "before"] and got["after"]["seconds"] == 0.02
    with probe.around(0) as none:
        pass
    assert none == {}
