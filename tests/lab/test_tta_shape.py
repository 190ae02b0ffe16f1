"""The time-to-accuracy tool at several ranks per replica (``--ranks-per-replica k``): every arm as M
replicas of k ranks at the recipe's global batch, and a study of one shape that never composes
another's records (pipesgd_lab/bench/tta_shape.py)."""

from __future__ import annotations

import copy
import json
import shlex

import pytest

from pipesgd_lab.bench import tta, tta_report
from pipesgd_lab.bench import tta_records as r
from pipesgd_lab.bench.tta_shape import Shape, run_shape, shape_for
from tests.lab.test_tta_records import _record, _summary, _timing


def test_k_ranks_per_replica_divide_the_recipes_batch_so_the_global_batch_stays():
    a = tta.parse(["--recipe", "gpt_shakespeare", "--ranks-per-replica", "2", "--phase", "curves"])
    # the recipe: 32 windows per rank on 2 ranks (global 64), 12 evaluation batches per rank
    assert a.shape == Shape(2, 2, (("data.batch_size", 16), ("trainer.eval_max_batches", 6)))
    assert 16 * a.shape.world == 32 * 2 and 6 * a.shape.world == 12 * 2  # the same batch, the same eval sample
    cmd = tta.train_command(a, "diloco-eager-int8-h25", "loopback", a.dir / "x")
    assert cmd[1:3] == ["-m", "pipesgd.train"]
    assert {"dist.nproc=4", "dist.ranks_per_replica=2", "data.batch_size=16", "trainer.eval_max_batches=6"} <= set(cmd)
    emulated = tta.train_command(a, "diloco-blocking-h25", "5mbit", a.dir / "x")
    assert emulated[1:7] == ["-m", "pipesgd_lab.emulate", "--workers", "2", "--ranks-per-replica", "2"]
    assert a.json.name == "time-to-target-gpt_shakespeare-2x2.json" and a.plot.name.endswith("-2x2.png")
    # the compute-alone arm exchanges nothing: the shape's batch on every rank, no replicas to form
    alone = tta.train_command(a, "compute", "5mbit", a.dir / "x")
    assert alone[1:5] == ["-m", "pipesgd_lab.emulate", "--workers", "4"] and "--ranks-per-replica" not in alone
    assert "data.batch_size=16" in alone and not any(w.startswith("dist.ranks_per_replica") for w in alone)
    # the user's batch is the one divided, and the divided one wins
    b = tta.parse(["--ranks-per-replica", "4", "--workers", "1", "--phase", "curves", "data.batch_size=48"])
    assert b.shape == Shape(1, 4, (("data.batch_size", 12),))  # resnet's recipe evaluates the whole test set
    words = tta.train_command(b, "sync", "loopback", b.dir / "x")
    assert words.index("data.batch_size=12") > words.index("data.batch_size=48")


def test_one_rank_per_replica_runs_exactly_as_before_the_option():
    a = tta.parse(["--recipe", "gpt_shakespeare"])
    assert a.shape == Shape(2) and a.shape.overrides() == [] and a.shape.label == ""
    cmd = tta.train_command(a, "diloco-eager-int8-h25", "1mbit", a.dir / "x")
    assert "--ranks-per-replica" not in cmd and not any("ranks_per_replica" in w for w in cmd)
    assert "dist.nproc=2" in cmd and a.json.name == "time-to-target-gpt_shakespeare.json"
    assert tta_report.timing_path(a).name == "timing.json"


@pytest.mark.parametrize("argv,message", [
    (["--ranks-per-replica", "0"], "argument --ranks-per-replica: must be an integer >= 1, got 0"),
    (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["--ranks-per-replica", "5"], "--ranks-per-replica 5 divides the recipe's per-rank batch (data.batch_size=32)"),
    (["--ranks-per-replica", "2", "dist.ranks_per_replica=2"],
     "override dist.ranks_per_replica=2: the study's shape is --ranks-per-replica"),
    (["--ranks-per-replica", "2", "--recipe", "no_such_recipe"], "argument --ranks-per-replica: +experiment=no_such"),
])
def test_a_shape_that_cannot_hold_is_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        tta.parse([*argv, "--phase", "curves"])
    assert message in capsys.readouterr().err


def test_torchfts_arms_run_in_groups_of_k_ranks_as_torchrun_jobs_on_every_link():
    a = tta.parse(["--recipe", "gpt_shakespeare", "--ranks-per-replica", "2", "--phase", "curves"])
    for link in ("loopback", "1mbit"):
        cmd = tta.train_command(a, "torchft-diloco-h25", link, a.dir / "x")
        assert cmd[1:9] == ["-m", "pipesgd_lab.bench.live_groups", "--workers", "2", "--ranks-per-replica", "2",
                            "--rate", link]
        assert ("--mtu" in cmd[:cmd.index("--")]) == (link != "loopback")  # a loopback row names no link MTU
        # the group's ranks are its torchrun job's: the batch divided, no dist.ranks_per_replica
        assert {"data.batch_size=16", "trainer.eval_max_batches=6"} <= set(cmd)
        assert not any(w.startswith("dist.ranks_per_replica") for w in cmd)
    assert r.link_mtu(" ".join(tta.train_command(a, "torchft-diloco-h25", "loopback", a.dir / "x"))) is None
    # one rank per group: as before, the live launcher on loopback
    assert tta.train_command(tta.parse(["--recipe", "gpt_shakespeare"]), "torchft-diloco-h25", "loopback",
                             a.dir / "x")[1:3] == ["-m", "pipesgd.train"]
    # a group's summary states its ranks; its config the groups
    group = _summary() | {"group_ranks": 2, "world_size": 2}
    group["config"] = copy.deepcopy(group["config"])
    group["config"]["trainer"]["live"] = {"replicas": 2}
    assert run_shape(group) == {"replicas": 2, "ranks_per_replica": 2} and a.shape.holds(run_shape(group))


def test_a_record_says_its_shape_as_it_ran_and_the_report_keeps_shapes_apart(tmp_path):
    two = _summary()
    two["config"] = copy.deepcopy(two["config"]) | {"dist": {"ranks_per_replica": 2}}
    two["world_size"] = 4
    assert run_shape(two) == {"replicas": 2, "ranks_per_replica": 2}
    assert run_shape(_summary()) == {"replicas": 2, "ranks_per_replica": 1}  # a config without the key: k = 1
    shape = shape_for(2, 2, {"data": {"batch_size": 32}})
    assert shape.holds(run_shape(two)) and not shape.holds(run_shape(_summary()))
    assert not shape.holds({"replicas": 4, "ranks_per_replica": 2}) and Shape(2).holds({})  # before the fields
    assert Shape(2).holds({"replicas": 1, "ranks_per_replica": 1})  # a torchft group's own summary, k = 1

    # a k = 2 study writes and reads its own names; a record under that name from another shape is refused
    a = tta.parse(["--ranks-per-replica", "2", "--phase", "report", "--arms", "sync", "--dir", str(tmp_path / "d"),
                   "--records", str(tmp_path / "records")])
    run_dir = tmp_path / "d" / "runs" / "sync-2x2-s0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(two))
    used, _ = tta_report.load_runs(a)
    assert [u["arm"] for u in used] == ["sync"] and used[0]["ranks_per_replica"] == 2
    assert (tmp_path / "records" / "sync-2x2-s0.json").exists()
    (run_dir / "summary.json").unlink()
    (tmp_path / "records" / "sync-2x2-s0.json").write_text(json.dumps(_record("sync", _summary()) | run_shape(_summary())))
    with pytest.raises(r.Refused, match="ran as 2 replica\\(s\\) of 1 rank\\(s\\), this study as 2 replica\\(s\\) of 2"):
        tta_report.load_runs(a)

    # timing: a file of one shape refuses another's rows; the shape's own overrides are the recipe's
    k2 = tta.train_command(a, "sync", "100mbit", tmp_path / "x", ["trainer.max_steps=50"])
    row = _timing("sync", shlex.join(["python", *k2[1:]])) | {"replicas": 2, "ranks_per_replica": 2}
    (tmp_path / "d" / "timing-2x2.json").write_text(json.dumps([row]))
    assert "100mbit" in tta_report.load_timing(a)
    (tmp_path / "d" / "timing-2x2.json").write_text(json.dumps([_timing("sync")]))
    with pytest.raises(r.Refused, match="ran as \\? replica\\(s\\) of 1 rank\\(s\\), this study as 2 replica"):
        tta_report.load_timing(a)
    with pytest.raises(r.Refused, match="ran with overrides"):  # a k = 1 row's batch is not the study's
        r.check_timing([_timing("sync")], a.recipe, tta.ARMS, tta_report.study_overrides(a))


def test_validation_records_of_another_shape_are_left_to_their_own_study(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    base = _record("sync", _summary()) | {"kind": "validate", "link": "100mbit", "steps_limit": None, "bracket": {}}
    (records / "validate-sync-100mbit.json").write_text(json.dumps(base | {"replicas": 2, "ranks_per_replica": 1}))
    (records / "validate-sync-2x2-100mbit.json").write_text(json.dumps(base | {"replicas": 2, "ranks_per_replica": 2}))
    links = {"100mbit": {"step_ms": {"sync": 100.0}, "eval_s": 1.0, "warmup_ms": {}, "unpriced": []}}
    for k, name in ((1, "validate-sync-100mbit.json"), (2, "validate-sync-2x2-100mbit.json")):
        a = tta.parse(["--ranks-per-replica", str(k), "--phase", "report", "--records", str(records)])
        rows = tta_report._validation(a, links, 90.0, {}, [])
        assert [row["record"] for row in rows] == [name]
