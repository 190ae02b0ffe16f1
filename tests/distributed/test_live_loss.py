"""The training loss the live mode logs (``train/loss``) is the mean over the replica groups that
contributed to the step's reduction, carried in the reduction's exact tail: two groups in their own
processes behind an in-process lighthouse on loopback, each the trainer's loop
(tests/live_loss_replica.py) on its own shard, so their own losses differ. Both log the same
value at every step, the mean of their two losses; a group that joins mid-run and heals
contributes nothing to the two reductions its share is zeroed in (the one it heals in, then its
stale gradient's), so both log its donor's loss alone there, and it logs nothing for its step
before the heal. Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from needs_torchft import require_torchft

require_torchft()

from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def _start(lighthouse: Lighthouse, replica: int, tmp_path: Path, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{replica}.log", "w")
    try:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "live_loss_replica.py"), "--lighthouse", lighthouse.address,
             "--run-id", "live-loss", "--replica", str(replica), "--out", str(tmp_path / f"{replica}.json"), *extra],
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}, cwd=tmp_path,
            stderr=log)
    finally:
        log.close()  # the child holds its own copy


def _steps(tmp_path: Path, replica: int) -> list[dict]:
    path = tmp_path / f"{replica}.json.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half written


def _wait_for(condition, timeout_s: float, what: str, procs: list[subprocess.Popen]) -> None:
    """Poll a group's progress in its file until ``condition``; fail naming ``what`` when a group
    exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a group exited while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], tmp_path: Path) -> list[dict]:
    """Every group's exit 0 and its result: each group's logged values by tag and step (ints), its
    own loss by step (the last line of a step: after a heal, the loop's step is its donor's) and
    how often it healed."""
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    logs = [(tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in range(len(procs))]
    assert codes == [0] * len(procs), "\n".join(logs)
    results = []
    for r in range(len(procs)):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        logged = {tag: {int(s): v for s, v in by_step.items()} for tag, by_step in res["logged"].items()}
        results.append({"loss": logged["train/loss"], "valid": logged.get("live/valid", {}), "healed": res["healed"],
                        "own": {line["step"]: line["own"] for line in _steps(tmp_path, r)}})
    return results


@pytest.mark.timeout(180)
def test_both_groups_log_the_mean_of_their_two_losses_at_every_step(tmp_path):
    lighthouse = Lighthouse(LighthouseOptions(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500))
    try:
        procs = [_start(lighthouse, r, tmp_path, "--steps", str(STEPS), "--min-replicas", "2") for r in (0, 1)]
        a, b = _finish(procs, tmp_path)
    finally:
        lighthouse.shutdown()
    steps = list(range(1, STEPS + 1))
    assert sorted(a["loss"]) == sorted(b["loss"]) == steps, "every step logged once, the last from the flush"
    assert all(a["valid"][s] == 2 for s in steps[1:]), "both groups contributed to every reduction"
    assert all(a["own"][s] != b["own"][s] for s in steps), "the groups' losses differ: the test would prove nothing"
    assert a["loss"] == b["loss"], "both log the same value"
    for s in steps:  # summed in float32 in the reduction's tail
        assert a["loss"][s] == pytest.approx((a["own"][s] + b["own"][s]) / 2, rel=1e-6, abs=0), s


@pytest.mark.timeout(240)
def test_a_healing_group_contributes_no_loss_to_the_reductions_its_share_is_zeroed_in(tmp_path):
    pause, steps = 6, 20
    lighthouse = Lighthouse(LighthouseOptions(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=500))
    go, procs = tmp_path / "go", []
    try:
        # group 0 trains alone to step `pause`, then waits; group 1 starts, takes one step of its
        # own (its first reduction waits for a quorum), and group 0 goes on: group 1 heals from it
        procs.append(_start(lighthouse, 0, tmp_path, "--steps", str(steps), "--pause-at", str(pause), "--go", str(go)))
        _wait_for(lambda: any(r["step"] == pause for r in _steps(tmp_path, 0)), 90, "group 0 at its pause", procs)
        procs.append(_start(lighthouse, 1, tmp_path, "--steps", str(steps)))
        _wait_for(lambda: _steps(tmp_path, 1), 90, "group 1's first step", procs)
        go.touch()
        a, b = _finish(procs, tmp_path)
    finally:
        lighthouse.shutdown()
    assert (a["healed"], b["healed"]) == (0, 1)
    assert sorted(a["loss"]) == list(range(1, steps + 1))
    for s in range(1, pause + 1):  # alone: its own loss, the mean over one group
        assert a["loss"][s] == a["own"][s]
    joined = min(b["loss"])
    assert joined > pause and sorted(b["loss"]) == list(range(joined, steps + 1)), \
        "the healer logs from its donor's step on, nothing for its own step before the heal"
    assert all(b["loss"][s] == a["loss"][s] for s in b["loss"]), "both log the same value"
    zeroed = [s for s in range(joined, steps) if a["valid"][s + 1] == 1]
    shared = [s for s in range(joined, steps) if a["valid"][s + 1] == 2]
    # the reduction the healer heals in and the next (its gradient of its old weights): its share zeroed
    assert zeroed == [joined, joined + 1] and shared == list(range(joined + 2, steps)), a["valid"]
    for s in zeroed:  # its donor's loss alone, exactly (a sum of one value and zeros, divided by 1)
        assert a["loss"][s] == a["own"][s]
    # the healer had a loss of its own at the second (of the weights it held before the heal): left out
    assert b["own"][joined + 1] != a["own"][joined + 1]
    for s in shared:
        assert a["loss"][s] == pytest.approx((a["own"][s] + b["own"][s]) / 2, rel=1e-6, abs=0), s
