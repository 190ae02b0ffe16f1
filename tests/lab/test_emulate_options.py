"""The emulated cluster's options without a cluster (no root, no namespaces): rates, the token
bucket's burst, the run directory chosen once, and a Cluster's arguments (tests/lab/test_emulate.py
runs the real thing)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipesgd_lab.emulate import Cluster, Shaping, format_rate, parse_rate
from pipesgd_lab.emulate.cli import resolve_run_dir


def test_parse_rate_si_units_and_rejects_bytes_per_second() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1Gbit") == 10**9
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert format_rate(parse_rate("250kbit")) == "250kbit"
    for bad in ("100mbps", "fast", "10"):  # bytes/s, no number, below 8kbit
        with pytest.raises(ValueError, match="rate="):
            parse_rate(bad)


def test_burst_is_two_ms_of_rate_but_at_least_16k() -> None:
    assert Shaping.for_rate(10**9).tc_args() == [
        "tbf", "rate", "1000000000bit", "burst", "250000", "latency", "50ms"
    ]  # fmt: skip
    assert Shaping.for_rate(10**6).burst_bytes == 16 * 1024


def test_a_slow_links_queue_holds_eight_jumbo_frames_and_a_fast_ones_keeps_50_ms() -> None:
    # 1mbit: 50 ms would queue 6 kB, under one 9014-byte frame; eight frames take 577 ms there
    assert Shaping.for_rate(10**6).tc_args()[-1] == "577ms"
    assert Shaping.for_rate(5 * 10**6).tc_args()[-1] == "115ms"
    assert Shaping.for_rate(25 * 10**6).tc_args()[-1] == "50ms"
    assert Shaping.for_rate(10**6, queue_s=1.0).tc_args()[-1] == "1000ms"  # a longer queue asked for is kept


def test_run_dir_chosen_once_user_value_wins() -> None:
    now = time.strptime("2030-01-02 03:04:05", "%Y-%m-%d %H:%M:%S")
    out, run_dir = resolve_run_dir(["a=1"], now)
    assert run_dir == str(Path.cwd() / "outputs/emulate/2030-01-02_03-04-05")
    assert out == ["a=1", f"hydra.run.dir={run_dir}"]
    out, run_dir = resolve_run_dir(["hydra.run.dir=/x/${now:%H-%M}", "b=2"], now)
    assert (out, run_dir) == (["hydra.run.dir=/x/03-04", "b=2"], "/x/03-04")
    out, run_dir = resolve_run_dir(["++hydra.run.dir=o/${hydra.job.name}"], now)
    assert (out, run_dir) == (["++hydra.run.dir=o/${hydra.job.name}"], None)


def test_cluster_validates_at_construction() -> None:
    with pytest.raises(ValueError, match="rates has 1 entries"):
        Cluster(2, ["100mbit"])
    with pytest.raises(ValueError, match=r"mtu=100 must be an integer in \[1280, 9000\]"):
        Cluster(2, "100mbit", mtu=100)
    with pytest.raises(ValueError, match="workers=0"):
        Cluster(0, "100mbit")


def test_ranks_per_replica_is_checked_before_anything_is_built(capsys: pytest.CaptureFixture[str]) -> None:
    from pipesgd_lab.emulate.cli import main

    for bad, why in (("0", "must be an integer >= 1 (ranks on each emulated host), got 0"),
                     ("-1", "must be an integer >= 1 (ranks on each emulated host), got -1"),
                     ("two", "invalid int value: 'two'")):
        with pytest.raises(SystemExit) as exit_:  # as a non-root user too: before the root check
            main(["--workers", "2", "--rate", "1gbit", "--ranks-per-replica", bad, "--", "x=1"])
        assert exit_.value.code == 2
        assert f"argument --ranks-per-replica: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an override that contradicts the flag: refused, naming both
        main(["--workers", "2", "--rate", "1gbit", "--ranks-per-replica", "2", "--", "dist.ranks_per_replica=4"])
    err = capsys.readouterr().err
    assert "--ranks-per-replica 2" in err and "dist.ranks_per_replica=4" in err
    with pytest.raises(ValueError, match="ranks_per_host=0 must be an integer >= 1"):
        Cluster(2, "100mbit", ranks_per_host=0)
    assert Cluster(3, "100mbit", ranks_per_host=2).world == 6


def test_ranks_per_replica_passes_the_key_once_and_only_when_not_one() -> None:
    from pipesgd_lab.emulate.cli import replica_overrides

    assert replica_overrides(["a=1"], 1) == ["a=1"]  # the library's default: the config need not know the key
    assert replica_overrides(["a=1"], 2) == ["a=1", "dist.ranks_per_replica=2"]
    assert replica_overrides(["++dist.ranks_per_replica=2"], 2) == ["++dist.ranks_per_replica=2"]
    with pytest.raises(ValueError, match=r"--ranks-per-replica 1 .* dist.ranks_per_replica=2"):
        replica_overrides(["dist.ranks_per_replica=2"], 1)
