"""The training loop's own collectives across live replica groups (pipesgd.live.peers): two groups
in their own processes behind an in-process lighthouse on loopback average their BatchNorm
buffers and a loss as an evaluation does, with a reduction in flight; the result is the two
groups' mean, as one process computes it. A group that dies where its peer averages costs the
survivor its average (it keeps its own values, says it was alone) and the update in flight, never a
hang. Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs_torchft import require_torchft

require_torchft()

from live_metric_replica import TIMEOUT_S  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _groups(tmp_path: Path, *extra: list[str]) -> tuple[list[int], list[dict | None]]:
    """Run one replica group per entry of ``extra`` (its own options) behind one lighthouse that
    forms no quorum without both (so both are in every quorum until one dies); each group's JSON
    result, None for a group that wrote none (its log: ``tmp_path/<replica>.log``). Every process is
    gone when this returns."""
    lighthouse = Lighthouse(LighthouseOptions(min_replicas=len(extra), heartbeat_timeout_ms=1000,
                                              join_timeout_ms=500))
    procs, logs = [], []
    try:
        for replica, options in enumerate(extra):
            logs.append(open(tmp_path / f"{replica}.log", "w"))
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "live_metric_replica.py"), "--lighthouse", lighthouse.address,
                 "--run-id", "live-metrics", "--replica", str(replica), "--out", str(tmp_path / f"{replica}.json"),
                 *options], env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"},
                cwd=tmp_path, stderr=logs[-1]))
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
        lighthouse.shutdown()
    results = [json.loads(f.read_text()) if (f := tmp_path / f"{r}.json").exists() else None
               for r in range(len(extra))]
    return codes, results


@pytest.mark.timeout(150)
def test_the_evaluation_average_over_live_groups_is_their_mean_as_one_process_computes_it(tmp_path):
    codes, (a, b) = _groups(tmp_path, [], [])
    assert codes == [0, 0]
    assert a["count"] == b["count"] == 2, "both groups of the quorum took part"
    assert a["own"] != b["own"], "the groups' buffers and losses differ (their own data): the test would prove nothing"
    for own_a, own_b, got_a, got_b in zip(a["own"], b["own"], a["averaged"], b["averaged"]):
        dtype = torch.float64 if len(own_a) == 1 else torch.float32  # the loss, else a BatchNorm buffer
        mean = ((torch.tensor(own_a, dtype=torch.float64) + torch.tensor(own_b, dtype=torch.float64)) / 2).to(dtype)
        assert torch.equal(torch.tensor(got_a, dtype=dtype), mean)
        assert torch.equal(torch.tensor(got_b, dtype=dtype), mean)
    assert a["applied"] and b["applied"], "an average that succeeds costs no update"


@pytest.mark.timeout(150)
def test_a_group_that_dies_during_the_average_leaves_the_survivor_its_own_values_without_a_hang(tmp_path):
    codes, (survivor, dead) = _groups(tmp_path, [], ["--die-in-metric"])
    assert codes[0] == 0 and codes[1] == -9 and dead is None
    assert survivor["count"] == 1, "the survivor says it averaged alone"
    assert survivor["averaged"] == survivor["own"], "the survivor keeps its own values"
    assert survivor["seconds"] < 2 * TIMEOUT_S + 20, "bounded by the live timeouts"
    log = (tmp_path / "0.log").read_text()
    assert "the test's average over the live replica groups not done (the sum failed: " in log, log[-2000:]
    assert survivor["skipped"] and not survivor["applied"], \
        "the failed average is reported to the Manager: the vote drops the update in flight"
