"""The training loop's own collectives across live replica groups (pipesgd.live.peers): two groups
in their own processes behind an in-process lighthouse on loopback evaluate with the trainer while
a reduction is in flight. Their BatchNorm buffers and recent losses are averaged over both, each
scores half the test set and the halves are summed: the score is a single process's over the whole
set. A group that dies where its peer averages, or while the two score their halves, never hangs
the survivor: it keeps its own buffers and loss, or scores the lost half itself, and says so.
Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

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

from live_metric_replica import eval_split, make_eval_model  # noqa: E402
from pipesgd.data.loader import EvalLoader  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402
from pipesgd.objective import Classification  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _groups(tmp_path: Path, *extra: list[str]) -> tuple[list[int], list[dict | None]]:
    """Run one replica group per entry of ``extra`` (its own options) behind one lighthouse that
    forms no quorum without all of them (so all are in every quorum until one dies); their exit
    codes and JSON results, None for a group that wrote none (its log: ``tmp_path/<replica>.log``).
    Every process is gone when this returns."""
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
        codes = [p.wait(timeout=90) for p in procs]  # a survivor hung in a collective fails here
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


def _saved(tmp_path: Path, replica: int) -> dict:
    return torch.load(tmp_path / f"{replica}.json.pt", weights_only=True)


def _reference(evaluated: dict, shares: int = 1) -> dict:
    """One process's score of the weights and buffers a group evaluated, over the whole test set,
    in ``shares`` contiguous shares added up (the groups' order of summing)."""
    model = make_eval_model()
    model.load_state_dict(evaluated)
    model.eval()
    objective = Classification()
    whole = EvalLoader(eval_split(), 16, 0, 1)
    totals = torch.zeros(objective.width, dtype=torch.float64)
    with torch.no_grad():
        for share in range(shares):
            part = torch.zeros(objective.width, dtype=torch.float64)
            for x, y in whole.share(share, shares):
                part += objective.sums(model(x), y)
            totals += part
    return objective.results(totals)


def _scored_like_one_process(result: dict, evaluated: dict) -> None:
    """``result`` is one process's score of ``evaluated``: bit for bit where that process scores
    the two halves and adds them; within float32 rounding of the whole set in one pass (batches
    cut elsewhere)."""
    halves = _reference(evaluated, shares=2)
    assert (result["test_accuracy"], result["test_loss"]) == (halves["test_accuracy"], halves["test_loss"])
    whole = _reference(evaluated)
    assert result["test_accuracy"] == whole["test_accuracy"]
    assert result["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)


@pytest.mark.timeout(150)
def test_an_evaluation_over_live_groups_is_one_processs_over_their_averaged_model(tmp_path):
    codes, (a, b) = _groups(tmp_path, [], [])
    assert codes == [0, 0]
    assert a["averaged_replicas"] == b["averaged_replicas"] == 2, "both groups of the quorum took part"
    assert a["own_loss"] != b["own_loss"], "the groups' losses differ (their own data): the test would prove nothing"
    assert a["final_train_loss"] == b["final_train_loss"] == pytest.approx((a["own_loss"] + b["own_loss"]) / 2)
    saved_a, saved_b = _saved(tmp_path, 0), _saved(tmp_path, 1)
    for name, own_a in saved_a["own_buffers"].items():
        own_b = saved_b["own_buffers"][name]
        assert not torch.equal(own_a, own_b), f"{name}: the groups' buffers already agree: nothing to prove"
        mean = ((own_a.double() + own_b.double()) / 2).to(own_a.dtype)
        assert torch.equal(saved_a["evaluated"][name], mean) and torch.equal(saved_b["evaluated"][name], mean)
    assert all(torch.equal(v, saved_b["evaluated"][k]) for k, v in saved_a["evaluated"].items()), "one model"
    for r in (a, b):  # each scored one half, the halves summed
        _scored_like_one_process(r, saved_a["evaluated"])
    assert a["applied"] and b["applied"], "an evaluation that succeeds costs no update"


@pytest.mark.parametrize("die", ["average", "score"])
@pytest.mark.timeout(150)
def test_a_group_that_dies_during_an_evaluation_does_not_hang_the_survivor(tmp_path, die):
    codes, (survivor, dead) = _groups(tmp_path, [], ["--die", die])
    assert codes[0] == 0 and codes[1] == -9 and dead is None
    log = (tmp_path / "0.log").read_text()
    if die == "average":  # alone: its own buffers and loss, the whole set scored by itself
        assert survivor["averaged_replicas"] == 1 and survivor["final_train_loss"] == survivor["own_loss"]
        saved = _saved(tmp_path, 0)
        assert all(torch.equal(saved["evaluated"][k], v) for k, v in saved["own_buffers"].items())
        assert "averaging buffers and losses for evaluation over the live replica groups not done (it failed:" in log
    else:  # averaged with the group that died; the half it would have added scored by the survivor
        assert survivor["averaged_replicas"] == 2
        assert "summing the evaluation's scores over the live replica groups not done (it failed:" in log
    evaluated = _saved(tmp_path, 0)["evaluated"]
    if die == "average":
        whole = _reference(evaluated)
        assert (survivor["test_accuracy"], survivor["test_loss"]) == (whole["test_accuracy"], whole["test_loss"])
    else:
        _scored_like_one_process(survivor, evaluated)
    assert survivor["skipped"] and not survivor["applied"], \
        "the failure is reported to the Manager: the vote drops the update in flight"
