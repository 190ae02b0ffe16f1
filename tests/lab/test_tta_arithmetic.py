"""The time-to-accuracy study's arithmetic against hand-computed values: targets, steps and time
to the target, the link means over seeds, speedups and ceilings, the table, the goals, and bad
arguments (tests/lab/test_tta.py runs the study end to end)."""

import pytest

from pipesgd_lab.bench import tta, tta_report
from pipesgd_lab.bench import tta_compose as c


def test_target_is_the_sync_mean_minus_the_slack():
    assert c.target_accuracy([90.2, 90.6]) == pytest.approx(90.1)
    with pytest.raises(ValueError, match="no finished 'sync' run"):
        c.target_accuracy([])


def test_steps_to_counts_the_evaluations_up_to_the_hit():
    curve = [[100, 50.0], [200, 80.0], [300, 79.0], [400, 90.0]]
    assert c.steps_to(curve, 80.0) == (200, 2)
    assert c.steps_to(curve, 85.0) == (400, 4)
    assert c.steps_to(curve, 95.0) is None


def test_time_charges_warmup_at_the_sync_rate_and_every_evaluation():
    curve = [[100, 50.0], [300, 90.0]]
    # 300 steps: 200 warm-up at 250 ms + 100 at 150 ms = 65 s, plus 2 evaluations of 10 s
    assert c.time_to(curve, 90.0, step_ms=150, eval_s=10, warmup_steps=200, warmup_ms=250) == pytest.approx(85.0)
    assert c.time_to(curve, 90.0, step_ms=150, eval_s=10) == pytest.approx(65.0)
    assert c.time_to(curve, 99.0, step_ms=150, eval_s=10) is None
    assert c.wall_curve(curve, 150, 10, 200, 250) == [[pytest.approx(35.0), 50.0], [pytest.approx(85.0), 90.0]]


def test_compose_link_means_over_seeds_and_refuses_a_partial_mean():
    runs = [{"name": "sync", "seed": 0, "curve": [[100, 80.0], [200, 90.0]]},
            {"name": "sync", "seed": 1, "curve": [[100, 90.0], [200, 91.0]]},
            {"name": "pipe", "seed": 0, "curve": [[100, 70.0], [200, 90.0]]},
            {"name": "pipe", "seed": 1, "curve": [[100, 70.0], [200, 80.0]]}]
    block = c.compose_link(runs, {"sync": 200.0, "pipe": 100.0, "ddp": 1.0}, 5.0, {"pipe": 0}, 90.0)
    # sync: seed 0 at step 200 (2 evals) = 40 + 10 s; seed 1 at step 100 (1 eval) = 20 + 5 s
    assert block["time_to_target_s"]["sync"] == pytest.approx((50 + 25) / 2)
    assert block["time_to_target_s"]["pipe"] is None, "seed 1 never reaches 90 %: no mean of the seed that did"
    assert block["speedup"]["sync"]["sync"] == 1.0 and block["speedup"]["sync"]["pipe"] is None
    assert "ddp" not in block["time_to_target_s"], "an arm with a step time but no curve is not composed"
    sweep = c.compose_link(runs, {"sync": 200.0, "pipe": 100.0}, 5.0, {}, {"target": 90.0, "85": 85.0})
    assert sweep["targets"]["85"]["time_s"] == {"sync": pytest.approx((50 + 25) / 2), "pipe": None}


def test_warmup_without_a_sync_step_time_is_not_priced_at_the_arms_rate_in_the_other_arm_accounting():
    runs = [{"name": "pipe", "seed": 0, "curve": [[100, 90.0]]}, {"name": "ddp-fp16", "seed": 0, "curve": [[100, 90.0]]}]
    block = c.compose_link(runs, {"pipe": 100.0, "ddp-fp16": 150.0}, 0.0, {"pipe": 20}, 90.0,
                           accounting=c.OTHER_ARM_RATE)
    assert "pipe" not in block["time_to_target_s"] and "sync arm's step time" in block["unpriced"]["pipe"]
    assert block["time_to_target_s"]["ddp-fp16"] == pytest.approx(15.0)


def test_powersgd_plain_steps_are_charged_at_ddps_rate_or_not_priced():
    runs = [{"name": "ddp-powersgd", "seed": 0, "curve": [[300, 90.0]]}]
    block = c.compose_link(runs, {"ddp-powersgd": 100.0, "ddp": 250.0, "sync": 1000.0}, 0.0,
                           {"ddp-powersgd": 200}, 90.0, {"ddp-powersgd": "ddp"}, accounting=c.OTHER_ARM_RATE)
    assert block["time_to_target_s"]["ddp-powersgd"] == pytest.approx((200 * 250 + 100 * 100) / 1e3)
    assert block["warmup_source"] == {"ddp-powersgd": "ddp step time"}
    block = c.compose_link(runs, {"ddp-powersgd": 100.0, "sync": 1000.0}, 0.0, {"ddp-powersgd": 200}, 90.0,
                           {"ddp-powersgd": "ddp"}, accounting=c.OTHER_ARM_RATE)
    assert "ddp-powersgd" not in block["time_to_target_s"] and "ddp arm's step time" in block["unpriced"]["ddp-powersgd"]


def test_the_headline_charges_each_warmup_at_its_own_rate():
    runs = [{"name": "ddp-powersgd", "seed": 0, "curve": [[300, 90.0]]},
            {"name": "pipe+lookahead-int8", "seed": 0, "curve": [[300, 90.0]]}]
    ms = {"ddp-powersgd": 100.0, "ddp": 250.0, "sync": 200.0, "pipe+lookahead-int8": 90.0}
    warm = {"ddp-powersgd": 200, "pipe+lookahead-int8": 200}
    # PowerSGD's plain steps timed as they ran (240 ms); int8's warm-up not timed: its own step time
    block = c.compose_link(runs, ms, 0.0, warm, 90.0, {"ddp-powersgd": "ddp"}, {"ddp-powersgd": 240.0})
    assert block["accounting"] == c.HEADLINE_ACCOUNTING == c.OWN_RATE
    assert block["time_to_target_s"] == {"ddp-powersgd": pytest.approx((200 * 240 + 100 * 100) / 1e3),
                                         "pipe+lookahead-int8": pytest.approx(300 * 90 / 1e3)}
    assert block["warmup_source"] == {"ddp-powersgd": "timed warm-up",
                                      "pipe+lookahead-int8": "own step time (warm-up not timed)"}
    old = c.compose_link(runs, ms, 0.0, warm, 90.0, {"ddp-powersgd": "ddp"}, {"ddp-powersgd": 240.0}, c.OTHER_ARM_RATE)
    assert old["time_to_target_s"] == {"ddp-powersgd": pytest.approx((200 * 250 + 100 * 100) / 1e3),
                                       "pipe+lookahead-int8": pytest.approx((200 * 200 + 100 * 90) / 1e3)}
    with pytest.raises(ValueError, match="accounting='mine' is not one of own_rate, other_arm_rate"):
        c.warmup_rate("sync", ms, accounting="mine")


def test_a_measured_warmup_rate_is_charged_instead_of_syncs():
    runs = [{"name": "pipe+lookahead-int8", "seed": 0, "curve": [[300, 90.0]]}]
    ms = {"pipe+lookahead-int8": 100.0, "sync": 200.0}
    block = c.compose_link(runs, ms, 0.0, {"pipe+lookahead-int8": 200}, 90.0, {}, {"pipe+lookahead-int8": 130.0})
    assert block["time_to_target_s"]["pipe+lookahead-int8"] == pytest.approx((200 * 130 + 100 * 100) / 1e3)
    assert block["warmup_ms"] == {"pipe+lookahead-int8": 130.0}
    old = c.compose_link(runs, ms, 0.0, {"pipe+lookahead-int8": 200}, 90.0, accounting=c.OTHER_ARM_RATE)
    assert old["time_to_target_s"]["pipe+lookahead-int8"] == pytest.approx((200 * 200 + 100 * 100) / 1e3)


def test_a_pipe_arms_timing_run_times_its_own_warmup_then_its_steps():
    a = tta.parse(["--skip", "10", "--steps", "40"])
    assert tta.timing_plan(a, "ddp-fp16") == {"total": 50, "overrides": ["trainer.warmup_sync_steps=0"],
                                              "warmup": None, "first": 10}
    plan = tta.timing_plan(a, "pipe+lookahead-int8")
    assert plan == {"total": 80, "overrides": ["trainer.warmup_sync_steps=30"], "warmup": (10, 30), "first": 40}
    # PowerSGD's plain allreduce steps are timed the same way: the hook compresses from step 30
    assert tta.timing_plan(a, "ddp-powersgd") == {
        "total": 80, "overrides": ["trainer.warmup_sync_steps=0", "compressor.ddp_start_iter=30"],
        "warmup": (10, 30), "first": 40}
    rows = [{"link": "100mbit", "arm": "pipe+lookahead-int8", "repeat": r, "iter_ms": [100.0 + r], "median_iter_ms": 100.0,
             "warmup_iter_ms": [130.0 + r], "eval_s": 1.0, "command": "python -m pipesgd.train", "date": "d"}
            for r in range(3)]
    block = tta_report.timing_by_link(rows)["100mbit"]
    assert block["warmup_ms"] == {"pipe+lookahead-int8": 131.0} and block["step_ms"]["pipe+lookahead-int8"] == 101.0


def test_an_arm_of_rounds_is_timed_in_whole_rounds_and_priced_by_their_mean_step():
    a = tta.parse(["--skip", "10", "--steps", "40"])
    # H = 25: one round left out (10 rounded up), two timed (40 rounded up to whole rounds)
    assert tta.timing_plan(a, "diloco-eager-int8-h25") == {"total": 75, "overrides": [], "warmup": None, "first": 25}
    assert tta.timing_plan(tta.parse(["--skip", "2", "--steps", "5"]), "torchft-diloco-h100") == {
        "total": 200, "overrides": [], "warmup": None, "first": 100}
    # a round's exchange step counts once per round: the mean of the window, not its median
    steps = [1000.0] * 24 + [41000.0]
    rows = [{"link": "1mbit", "arm": "torchft-diloco-h25", "repeat": 0, "iter_ms": steps, "median_iter_ms": 1000.0,
             "eval_s": 1.0, "command": "python -m pipesgd_lab.bench.live_groups", "date": "d"}]
    assert tta_report.timing_by_link(rows)["1mbit"]["step_ms"]["torchft-diloco-h25"] == pytest.approx(2600.0)


def test_torchfts_arms_run_behind_a_lighthouse_on_emulated_nodes_and_the_others_under_emulate(tmp_path):
    a = tta.parse(["--recipe", "gpt_shakespeare"])
    cmd = tta.train_command(a, "torchft-streaming-h25", "1mbit", tmp_path)
    assert cmd[1:3] == ["-m", "pipesgd_lab.bench.live_groups"] and "trainer.sync_delay=4" in cmd
    assert tta.train_command(a, "diloco-eager-int8-h25", "1mbit", tmp_path)[1:3] == ["-m", "pipesgd_lab.emulate"]
    assert tta.train_command(a, "torchft-diloco-h25", "loopback", tmp_path)[1:3] == ["-m", "pipesgd.train"]


def test_speedups_against_the_fastest_ddp_arm_and_the_ceiling():
    runs = [{"name": n, "seed": 0, "curve": [[100, 90.0]]} for n in ("ddp-fp16", "ddp-powersgd", "pipe+lookahead")]
    ms = {"ddp-fp16": 200.0, "ddp-powersgd": 160.0, "pipe+lookahead": 120.0, "compute": 100.0}
    block = c.compose_link(runs, ms, 0.0, {}, 90.0)
    assert block["targets"]["target"]["best_ddp"] == "ddp-powersgd"
    assert block["speedup"]["best ddp"]["pipe+lookahead"] == pytest.approx(160 / 120)
    cap = c.ceiling(ms)
    assert cap["best_ddp"] == "ddp-powersgd" and cap["ceiling_speedup"] == pytest.approx(1.6)
    assert cap["captured"]["pipe+lookahead"] == pytest.approx(40 / 60)


def test_crossings_give_each_seeds_margin():
    assert c.crossings([[100, 80.0], [200, 90.25]], {"target": 90.0, "high": 91.0}) == {
        "target": {"step": 200, "margin_pp": pytest.approx(0.25)}, "high": None}


def test_validation_row_compares_with_the_runs_own_clock():
    curve = [[100, 80.0], [200, 91.0]]
    row = c.validation_row("sync", "100mbit", curve, [30.0, 62.0], 90.0, step_ms=250, eval_s=5)
    assert row["composed_s"] == pytest.approx(60.0) and row["measured_s"] == 62.0
    assert row["rel_error"] == pytest.approx(-2 / 62) and row["at_step"] == 200


def test_validation_row_of_a_shortened_run_compares_at_its_last_evaluation():
    curve = [[100, 40.0], [150, 50.0]]
    row = c.validation_row("pipe", "50mbit", curve, [30.0, 49.0], None, step_ms=250, eval_s=5,
                           warmup_steps=20, warmup_ms=400)
    assert row["at_step"] == 150 and row["measured_s"] == 49.0
    assert row["composed_s"] == pytest.approx((20 * 400 + 130 * 250) / 1e3 + 2 * 5)


def test_table_has_a_row_per_arm_with_speedups():
    result = {"target_accuracy": 90.0, "arms": [
        {"name": "sync", "seed": 0, "final_test_accuracy": 90.3, "curve": [[100, 90.5]]},
        {"name": "pipe", "seed": 0, "final_test_accuracy": 90.1, "curve": [[100, 90.2]]}],
        "links": {"100mbit": c.compose_link(
            [{"name": "sync", "seed": 0, "curve": [[100, 90.5]]}, {"name": "pipe", "seed": 0, "curve": [[100, 90.2]]}],
            {"sync": 300.0, "pipe": 200.0}, 0.0, {}, 90.0)}}
    lines = c.table(result).splitlines()
    assert len(lines) == 4 and lines[3].startswith("| pipe | 1 | 90.10 | 100 | 200 | 0.3 min | 1.50× / – |")


def _goal_result(step_ms: dict, validation=()) -> dict:
    """sync ends at 90.4 %, int8 at 90.35 % (same accuracy), plain pipe at 89.0 % (not eligible)."""
    curves = {"sync": [[100, 89.0], [200, 90.4]], "ddp-fp16": [[100, 89.0], [200, 90.4]],
              "pipe+lookahead-int8": [[100, 89.0], [200, 90.35]], "pipe": [[100, 90.2], [200, 89.0]]}
    arms = [{"name": n, "seed": 0, "complete": True, "final_test_accuracy": cv[-1][1], "curve": cv}
            for n, cv in curves.items()]
    targets = c.targets_from([90.4])
    runs = [{"name": r["name"], "seed": 0, "curve": r["curve"]} for r in arms]
    block = c.compose_link(runs, step_ms, 0.0, {}, targets) | {"ceiling": c.ceiling(step_ms)}
    return {"arms": arms, "targets": targets, "links": {"100mbit": block}, "validation": list(validation)}


def test_speed_goal_takes_the_worst_slack_and_only_arms_at_sync_accuracy():
    # compute alone 100 ms against ddp-fp16's 300: the ceiling (3x) is above 1.15x, so speedup applies
    result = _goal_result({"sync": 400.0, "ddp-fp16": 300.0, "pipe+lookahead-int8": 250.0, "pipe": 10.0,
                           "compute": 100.0})
    speed = c.goals(result, {"100mbit": 1.15})[0]
    assert speed["applies"] == "speedup" and speed["eligible_arms"] == ["pipe+lookahead-int8"]
    # slack 0.1 (90.3): int8 reaches it at step 200, ddp-fp16 at 200 -> 1.2x; the 1000x-faster pipe arm ends 1.4 pp low
    assert speed["value"] == pytest.approx(300 / 250) and speed["met"] is True
    assert c.goals(result, {"100mbit": 1.25})[0]["met"] is False


def test_speed_goal_becomes_capture_under_a_low_ceiling():
    result = _goal_result({"sync": 400.0, "ddp-fp16": 110.0, "pipe+lookahead-int8": 102.0, "compute": 100.0})
    speed = c.goals(result, {"100mbit": 1.15})[0]
    assert speed["applies"] == "capture" and speed["value"] == pytest.approx(0.8) and speed["met"] is True
    result = _goal_result({"sync": 400.0, "ddp-fp16": 110.0, "pipe+lookahead-int8": 103.0, "compute": 100.0})
    assert c.goals(result, {"100mbit": 1.15})[0]["met"] is False
    assert "missed" in c.goals_table(c.goals(result, {"100mbit": 1.15}))
    assert "provisional" not in c.goals(result, {"100mbit": 1.15})[0]
    result["links"]["100mbit"]["ceiling"] = c.ceiling({"ddp-fp16": 110.0, "ddp-powersgd": 101.0,
                                                       "pipe+lookahead-int8": 103.0, "compute": 100.0})
    speed = c.goals(result, {"100mbit": 1.15})[0]
    assert speed["met"] is False and "ddp-powersgd, the fastest DDP arm per step, has no curve" in speed["provisional"]


def test_a_ddp_arm_that_never_reaches_the_target_sets_no_ceiling():
    # ddp-powersgd is the fastest step (101 ms) but its curve ends at 89.5 %: the ceiling is ddp-fp16's
    step_ms = {"sync": 400.0, "ddp-fp16": 110.0, "ddp-powersgd": 101.0, "pipe+lookahead-int8": 102.0,
               "compute": 100.0}
    result = _goal_result(step_ms)
    result["arms"].append({"name": "ddp-powersgd", "seed": 0, "complete": True, "final_test_accuracy": 89.5,
                           "curve": [[100, 89.0], [200, 89.5]]})
    runs = [{"name": r["name"], "seed": 0, "curve": r["curve"]} for r in result["arms"]]
    assert c.ceiling(step_ms)["best_ddp"] == "ddp-powersgd", "per step alone it would set the ceiling"
    block = c.compose_link(runs, step_ms, 0.0, {}, result["targets"])
    cap = c.link_ceiling(block)
    assert cap["best_ddp"] == "ddp-fp16" and cap["ddp_arms_never_at_target"] == ["ddp-powersgd"]
    assert cap["captured"]["pipe+lookahead-int8"] == pytest.approx(0.8), "the table's capture column agrees"
    result["links"]["100mbit"] = block | {"ceiling": cap}
    speed = c.goals(result, {"100mbit": 1.15})[0]
    assert speed["ddp_arms_never_at_target"] == ["ddp-powersgd"] and "provisional" not in speed
    assert speed["ceiling_speedup"] == pytest.approx(1.10) and speed["value"] == pytest.approx(0.8)
    assert speed["met"] is True
    assert "ddp-powersgd never reaches the target" in c.goals_table([speed])


def test_accuracy_and_validation_goals_say_what_they_lack():
    ms = {"sync": 400.0, "ddp-fp16": 300.0, "pipe+lookahead-int8": 250.0, "compute": 100.0}
    rows = {g["goal"]: g for g in c.goals(_goal_result(ms), {"100mbit": 1.15})}
    assert rows["accuracy pipe+lookahead-int8"]["value"] == pytest.approx(-0.05)
    assert rows["accuracy pipe+lookahead-int8"]["met"] is True
    assert rows["accuracy pipe+lookahead-fp16"]["met"] is None
    assert rows["validation sync"]["met"] is None and "no validation record" in rows["validation sync"]["why"]
    validated = _goal_result(ms, [{"arm": "sync", "rel_error": 0.02}, {"arm": "pipe+lookahead-int8", "rel_error": -0.07}])
    rows = {g["goal"]: g for g in c.goals(validated, {"100mbit": 1.15})}
    assert rows["validation sync"]["met"] is True
    assert rows["validation pipe+lookahead-int8"]["met"] is False, "the headline arm is the speed goal's arm"
    # another validated arm (the best DDP arm, the ratios' divisor) is judged too; sync, unvalidated, says so
    validated = _goal_result(ms, [{"arm": "ddp-powersgd", "rel_error": -0.027}, {"arm": "pipe+lookahead-int8",
                                                                                 "rel_error": -0.004}])
    rows = {g["goal"]: g for g in c.goals(validated, {"100mbit": 1.15})}
    assert rows["validation ddp-powersgd"]["met"] is True and rows["validation ddp-powersgd"]["value"] == -0.027
    assert rows["validation sync"]["met"] is None and rows["validation pipe+lookahead-int8"]["met"] is True
    assert list(rows)[-3:] == ["validation sync", "validation pipe+lookahead-int8", "validation ddp-powersgd"]


def test_the_validation_goal_judges_steady_window_runs_where_there_are_any():
    ms = {"sync": 400.0, "ddp-fp16": 300.0, "pipe+lookahead-int8": 250.0, "compute": 100.0}
    early = {"arm": "sync", "rel_error": -0.06, "record": "early.json", "window": {"first": 10, "steps": 40}}
    steady = {"arm": "sync", "rel_error": 0.03, "record": "steady.json", "window": {"first": 100, "steps": 100}}
    short = {"arm": "sync", "rel_error": 0.01, "record": "short.json", "window": {"first": 100, "steps": 40}}
    goal = next(g for g in c.goals(_goal_result(ms, [early, steady, short]), {"100mbit": 1.15})
                if g["goal"] == "validation sync")
    assert goal["met"] is True and goal["value"] == 0.03 and goal["judged"] == ["steady.json"]
    assert goal["left_out"] == {"early.json": -0.06, "short.json": 0.01}
    assert "earlier short-window runs left out: -6.0 %, +1.0 %" in c.goals_table([goal])
    # with no steady-window run, every run is judged, as before
    goal = next(g for g in c.goals(_goal_result(ms, [early, short]), {"100mbit": 1.15})
                if g["goal"] == "validation sync")
    assert goal["met"] is False and goal["value"] == -0.06 and goal["left_out"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--arms", "sync,nope"], "nope is not one of"),
    (["--seeds", "a"], "not a comma-separated list of integers"),
    (["--repeats", "0"], "--repeats: must be an integer >= 1, got 0"),
    (["--phase", "curves,plots"], "plots is not one of"),
    (["oops"], "positional arguments are Hydra overrides"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tta.parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
