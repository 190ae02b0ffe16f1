"""The time-to-accuracy report cannot mix or drop runs: on small synthetic records, a
partial run is listed as unfinished and never composed, runs of another config and timing records of
another recipe are refused, naming what differs."""

import copy
import json
from types import SimpleNamespace

import pytest

from pipesgd_lab.bench import tta
from pipesgd_lab.bench import tta_report
from pipesgd_lab.bench import tta_records as r
from pipesgd_lab.bench.tta_shape import Shape

CONFIG = {"seed": 0, "trainer": {"mode": "sync", "width": 1, "warmup_sync_steps": 0, "epochs": 3, "max_steps": None},
          "compressor": {"_target_": "pipesgd.compress.none.NoCompression"},
          "optimizer": {"lr": 0.2}, "data": {"root": "/somewhere", "batch_size": 32}}


def _summary(mode="sync", width=1, staleness="none", compressor="none", steps=300, total=300, **trainer):
    config = copy.deepcopy(CONFIG)
    config["trainer"].update(mode=mode, width=width, **trainer)
    config["staleness"] = {"_target_": f"pipesgd.staleness.{staleness}"}  # the group (synthetic target)
    return {"mode": mode, "width": width, "staleness": staleness, "compressor": compressor, "steps": steps,
            "total_steps": total, "world_size": 2, "test_accuracy": 0.9, "git_commit": "abc",
            "evals": [{"step": 150, "test_accuracy": 0.8, "elapsed_s": 10.0, "eval_s": 1.0},
                      {"step": steps, "test_accuracy": 0.9, "elapsed_s": 20.0, "eval_s": 1.0}],
            "config": config}


def _record(arm, summary, seed=0):
    return r.curve_record(arm, seed, tta.ARMS[arm], "resnet_cifar_tta", summary, [{"commit": "abc"}])


def test_a_finished_run_is_complete_and_keeps_its_commits():
    rec = _record("sync", _summary())
    assert rec["complete"] and rec["final_test_accuracy"] == pytest.approx(90.0)
    assert rec["curve"] == [[150, pytest.approx(80.0)], [300, pytest.approx(90.0)]]
    assert rec["segments"] == [{"commit": "abc"}] and rec["git_commit_at_end"] == "abc"
    assert "root" not in rec["config"]["data"], "bookkeeping keys are not the recipe"


def test_a_run_whose_checkout_moved_keeps_the_commit_at_its_end():
    rec = _record("sync", {**_summary(), "git_commit_at_end": "def"})
    assert rec["git_commit_at_end"] == "def"


def test_a_partial_run_is_listed_unfinished_and_not_used():
    partial = _record("sync", _summary(steps=150, total=300))
    assert not partial["complete"] and partial["why_incomplete"] == "150 of 300 steps"
    used, unfinished = r.usable_curves({("sync", 0): _record("sync", _summary()), ("sync", 1): partial})
    assert [u["seed"] for u in used] == [0] and unfinished == [partial]


def test_a_summary_without_total_steps_is_judged_by_its_last_evaluation():
    s = _summary()
    del s["total_steps"]
    assert _record("sync", s)["complete"]


def test_a_run_that_is_not_its_arm_is_not_complete():
    # the record says pipe+lookahead, but summary.json says plain staleness ran
    rec = _record("pipe+lookahead", _summary(mode="pipe", width=2, staleness="none", warmup_sync_steps=200))
    assert not rec["complete"] and "staleness=lookahead asked, staleness=none ran" in rec["why_incomplete"]
    # a dotted override the summary does not state is checked in the config
    rec = _record("sync", _summary(warmup_sync_steps=100))
    assert not rec["complete"] and "trainer.warmup_sync_steps=0 asked, 100 ran" in rec["why_incomplete"]


def test_an_outer_step_left_to_auto_is_judged_by_the_step_that_ran():
    arm = ["outer_optimizer.lr=0.7", "outer_optimizer.momentum=0.9", "outer_optimizer.nesterov=true"]
    s = _summary()
    s["config"]["outer_optimizer"] = {"_target_": "torch.optim.SGD", "lr": None, "momentum": None, "nesterov": None}
    ran = s | {"outer_step": {"optimizer": "SGD", "lr": 0.7, "momentum": 0.9, "nesterov": True}}
    assert r.arm_mismatch({}, arm, r.ran_config(ran)) is None
    assert r.arm_mismatch({}, arm, r.ran_config(s)) == "outer_optimizer.lr=0.7 asked, None ran"
    plain = s | {"outer_step": {"optimizer": "SGD", "lr": 1.0, "momentum": 0.0, "nesterov": False}}
    assert r.arm_mismatch({}, arm, r.ran_config(plain)) == "outer_optimizer.lr=0.7 asked, 1.0 ran"
    s["config"]["outer_optimizer"]["lr"] = 0.5  # a value set by hand is what ran, whatever the record says
    assert r.ran_config(ran | {"config": s["config"]})["outer_optimizer"]["lr"] == 0.5


def test_an_override_of_null_is_the_none_a_config_holds():
    from pipesgd_lab.bench.tta_records import arm_mismatch

    assert arm_mismatch({}, ["trainer.check_every=null"], {"trainer": {"check_every": None}}) is None
    assert arm_mismatch({}, ["trainer.check_every=null"], {"trainer": {"check_every": 100}}) == \
        "trainer.check_every=null asked, 100 ran"


def test_runs_of_another_config_are_refused_naming_the_difference():
    sync = _record("sync", _summary())
    pipe = _record("pipe+lookahead", _summary(mode="pipe", width=2, staleness="lookahead", warmup_sync_steps=200))
    assert r.usable_curves({("sync", 0): sync, ("pipe+lookahead", 0): pipe})[0] == [sync, pipe]
    other = _summary(mode="pipe", width=2, staleness="lookahead", warmup_sync_steps=200)
    other["config"]["optimizer"]["lr"] = 0.1
    with pytest.raises(r.Refused, match=r"pipe\+lookahead seed 1 ran another config .*optimizer.lr: 0.2 -> 0.1"):
        r.usable_curves({("sync", 0): sync, ("pipe+lookahead", 1): _record("pipe+lookahead", other, seed=1)})
    # two pipe arms whose shared warm-up differs: neither overrides it, so it is the recipe
    fewer = _summary(mode="pipe", width=2, staleness="none", warmup_sync_steps=100)
    with pytest.raises(r.Refused, match="warmup_sync_steps: 200 -> 100"):
        r.usable_curves({("sync", 0): sync, ("pipe+lookahead", 0): pipe, ("pipe", 0): _record("pipe", fewer)})
    # another world size is another recipe too
    wider = _summary()
    wider["world_size"] = 4
    with pytest.raises(r.Refused, match="world_size: 2 -> 4"):
        r.usable_curves({("sync", 0): sync, ("sync", 1): _record("sync", wider, seed=1)})


def _timing(arm="sync", command=None, link="100mbit"):
    overrides = " ".join(tta.ARMS[arm])
    command = command or (f"python -m pipesgd_lab.emulate --workers 2 --rate {link} --timeout-s 86400 -- "
                          f"+experiment=resnet_cifar_tta {overrides} dist.nproc=2 data.root=/d "
                          "trainer.max_steps=50 trainer.warmup_sync_steps=0 trainer.resume=never hydra.run.dir=/x")
    return {"link": link, "arm": arm, "repeat": 0, "command": command, "iter_ms": [1.0], "median_iter_ms": 1.0,
            "eval_s": 1.0, "date": "2026-11-25"}


def test_timing_records_of_another_recipe_are_refused():
    ok = [_timing("sync"), _timing("ddp-fp16")]
    assert r.check_timing(ok, "resnet_cifar_tta", tta.ARMS, ["data.root=/elsewhere"]) == ok
    with pytest.raises(r.Refused, match="ran \\+experiment=mnist_mlp, not resnet_cifar_tta"):
        r.check_timing([_timing(command="python -m pipesgd.train +experiment=mnist_mlp trainer.mode=sync")],
                       "resnet_cifar_tta", tta.ARMS, [])
    lr = _timing()
    lr["command"] += " optimizer.lr=0.1"
    with pytest.raises(r.Refused, match="optimizer.lr"):
        r.check_timing([lr], "resnet_cifar_tta", tta.ARMS, [])
    stale = _timing("ddp-fp16")
    stale["command"] = stale["command"].replace("compressor=fp16", "compressor=bf16")
    with pytest.raises(r.Refused, match="ran the arm as"):
        r.check_timing([stale], "resnet_cifar_tta", tta.ARMS, [])


def test_a_recorded_command_with_the_removed_staleness_alias_is_read_as_the_group():
    """Commands stay as they ran; trainer.staleness meant exactly the group, so a timing record of
    that spelling is the arm, and a rerun of its curve spells it the way the CLI accepts now."""
    from pipesgd_lab.bench.tta_reproduce import _train_args

    old = _timing("pipe+lookahead")
    old["command"] = old["command"].replace(" staleness=lookahead", " trainer.staleness=lookahead")
    assert "trainer.staleness=lookahead" in old["command"]
    assert r.check_timing([old], "resnet_cifar_tta", tta.ARMS, []) == [old]
    other = dict(old, command=old["command"].replace("trainer.staleness=lookahead", "trainer.staleness=none"))
    with pytest.raises(r.Refused, match="ran the arm as .*'staleness=none'"):
        r.check_timing([other], "resnet_cifar_tta", tta.ARMS, [])
    record = {"segments": [{"command": "python -m pipesgd.train +experiment=x trainer.staleness=dc seed=1"}]}
    assert _train_args(record) == ["+experiment=x", "staleness=dc", "seed=1"]


def test_a_powersgd_timing_run_times_the_hook_and_its_curve_charges_the_plain_steps_at_ddps_rate():
    timed = _timing("ddp-powersgd")
    timed["command"] += " compressor.ddp_start_iter=30"
    assert r.check_timing([timed], "resnet_cifar_tta", tta.ARMS, []) == [timed]
    hook = {"_target_": tta_report.POWERSGD, "rank": 2}
    assert tta_report._warmup({"config": {"trainer": {"mode": "ddp"}, "compressor": hook}}) == (1000, "ddp")
    assert tta_report._warmup({"config": {"trainer": {"mode": "ddp"}, "compressor": hook | {"ddp_start_iter": 7}}}) == (7, "ddp")
    assert tta_report._warmup({"config": {"trainer": {"mode": "pipe", "warmup_sync_steps": 200}, "compressor": {}}}) == (200, "sync")
    assert tta_report._warmup({"config": {"trainer": {"mode": "ddp"}, "compressor": {"_target_": "x.FP16"}}}) == (0, None)


def test_the_report_uses_records_and_lists_what_it_did_not_use(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    for arm, summary in (("sync", _summary()), ("pipe+lookahead", _summary(mode="pipe", width=2,
                                                                             staleness="lookahead", steps=150))):
        (records / f"{arm}-s0.json").write_text(json.dumps(_record(arm, summary)))
    a = SimpleNamespace(arms=["sync", "pipe+lookahead", "pipe"], seeds=[0], dir=tmp_path / "d", records=records,
                        recipe="resnet_cifar_tta", overrides=[], timing=None, validate_arms=[], steps=1, skip=0,
                        repeats=1, workers=2, stamp_host=set(), mixed_hosts=False, validations=None,
                        shape=Shape(2))
    used, unfinished = tta_report.load_runs(a)
    assert [u["arm"] for u in used] == ["sync"]
    assert {(u["arm"], u["why_incomplete"]) for u in unfinished} == {("pipe+lookahead", "150 of 300 steps"),
                                                                     ("pipe", "no run")}
    result = tta_report.build_result(a, used, unfinished, {})
    assert [(x["name"], x["complete"]) for x in result["arms"]] == [("sync", True), ("pipe+lookahead", False),
                                                                    ("pipe", False)]
    assert result["arms"][1]["final_test_accuracy"] is None


def test_a_config_keeping_a_keys_removed_alias_beside_it_is_still_one_recipe():
    """Runs of a commit whose config kept ``trainer.staleness`` beside the ``staleness`` group: an
    arm's ``staleness=...`` sets both, so neither makes two arms different recipes."""
    from pipesgd_lab.bench.tta_records import usable_curves

    def rec(arm, rule, overrides):
        config = {"seed": 0, "trainer": {"mode": "pipe", "staleness": rule}, "staleness": {"_target_": rule},
                  "optim": {"lr": 0.1}}
        return {"arm": arm, "seed": 0, "complete": True, "config": config, "arm_overrides": overrides,
                "world_size": 2}

    one, other = rec("a", "none", ["staleness=none"]), rec("b", "lookahead", ["staleness=lookahead"])
    used, _ = usable_curves({("a", 0): one, ("b", 0): other})
    assert len(used) == 2
    other["config"]["optim"]["lr"] = 0.2
    with pytest.raises(r.Refused, match="optim.lr"):
        usable_curves({("a", 0): one, ("b", 0): other})


def test_a_config_with_the_removed_dc_aliases_is_still_the_recipe_of_one_without():
    """A curve run at a commit whose config kept ``trainer.dc_lambda`` / ``trainer.dc_adaptive``
    (the dc rule's settings before the staleness group held them) and one run after: both arms set
    ``staleness=...``, so the rule's settings are not what makes a recipe (2026-11-28: DDP +
    PowerSGD seed 1 was refused against sync seed 0 for exactly these)."""
    from pipesgd_lab.bench.tta_records import usable_curves

    def rec(arm, trainer, overrides):
        config = {"seed": 0, "trainer": {"mode": "ddp", **trainer}, "staleness": {"_target_": "Plain"},
                  "optim": {"lr": 0.1}}
        return {"arm": arm, "seed": 0, "complete": True, "config": config, "arm_overrides": overrides,
                "world_size": 2}

    older = rec("a", {"dc_lambda": 0.04, "dc_adaptive": False}, ["staleness=none"])
    newer = rec("b", {}, ["staleness=none"])
    assert len(usable_curves({("a", 0): older, ("b", 0): newer})[0]) == 2
    newer["config"]["trainer"]["mode"] = "pipe"
    with pytest.raises(r.Refused, match="trainer.mode"):
        usable_curves({("a", 0): older, ("b", 0): newer})


def test_a_mode_owned_section_of_a_mode_no_run_ran_is_not_the_recipe():
    """``trainer.live`` (read only by trainer.mode=live) appeared in the config after some curves
    ran: a run that records it and one from before are one recipe while neither runs live, and a
    difference in it still counts between two live runs."""
    older = _record("sync", _summary())
    newer_summary = _summary(mode="pipe", width=2, staleness="lookahead", warmup_sync_steps=200)
    newer_summary["config"]["trainer"]["live"] = {"timeout_s": 30.0}
    newer = _record("pipe+lookahead", newer_summary)
    assert len(r.usable_curves({("sync", 0): older, ("pipe+lookahead", 0): newer})[0]) == 2
    live = [{"arm": "x", "seed": s, "complete": True, "arm_overrides": [], "world_size": 2,
             "config": {"seed": s, "trainer": {"mode": "live", "live": {"timeout_s": t}}}} for s, t in ((0, 30.0), (1, 2.0))]
    with pytest.raises(r.Refused, match=r"trainer.live.timeout_s: 30.0 -> 2.0"):
        r.usable_curves({("x", 0): live[0], ("x", 1): live[1]})


def test_a_mode_owned_section_goes_with_an_arm_that_changes_the_mode():
    """An arm that sets trainer.mode brings that mode's own section (trainer.live) with it: it is
    no difference of recipe against an arm of another mode, which has none."""
    live = {"arm": "x", "seed": 0, "complete": True, "arm_overrides": ["trainer.mode=live"], "world_size": 2,
            "config": {"seed": 0, "trainer": {"mode": "live", "live": {"timeout_s": 30.0}}}}
    sync = {"arm": "y", "seed": 0, "complete": True, "arm_overrides": [], "world_size": 2,
            "config": {"seed": 0, "trainer": {"mode": "sync"}}}
    assert len(r.usable_curves({("x", 0): live, ("y", 0): sync})[0]) == 2
    sync["config"]["optimizer"] = {"lr": 0.2}
    with pytest.raises(r.Refused, match="optimizer"):
        r.usable_curves({("x", 0): live, ("y", 0): sync})


def test_a_curve_from_before_an_option_existed_composes_with_one_that_has_it_off():
    """A record whose config predates an option (no trainer.max_grad_norm) and one whose config has
    it at None, its off default, ran the same recipe; one with it set did not."""
    old = {"arm": "x", "seed": 0, "complete": True, "arm_overrides": [], "world_size": 2,
           "config": {"seed": 0, "trainer": {"mode": "sync"}}}
    new = {"arm": "y", "seed": 0, "complete": True, "arm_overrides": [], "world_size": 2,
           "config": {"seed": 0, "trainer": {"mode": "sync", "max_grad_norm": None}}}
    assert len(r.usable_curves({("x", 0): old, ("y", 0): new})[0]) == 2
    new["config"]["trainer"]["max_grad_norm"] = 1.0
    with pytest.raises(r.Refused, match=r"trainer.max_grad_norm: '<unset>' -> 1.0"):
        r.usable_curves({("x", 0): old, ("y", 0): new})
