"""The validation phase brackets each end-to-end run with timing runs of its arm, and the report
composes the run against that bracket (not against a timing run of another hour), with the
before-only and after-only compositions beside it. Driver order and composition on synthetic
records, no workers."""

import json
from types import SimpleNamespace

import pytest

from pipesgd_lab.bench import tta, tta_report
from pipesgd_lab.bench.tta_shape import Shape
from tests.lab.test_tta_records import _record, _summary, _timing


def _args(tmp_path, **kw):
    return SimpleNamespace(**{"links": ["100mbit"], "validate_arms": ["sync"], "seeds": [0], "dir": tmp_path / "d",
                              "records": tmp_path / "records", "validations": None, "recipe": "resnet_cifar_tta", "overrides": [],
                              "validate_steps": None, "validate_bracket": 1, "workers": 2, "shape": Shape(2), "timeout_s": 60.0,
                              "mtu": 9000, "steps": 40, "skip": 10, "bracket_skip": 100, "bracket_steps": 100,
                              "stamp_host": set(), "mixed_hosts": False} | kw)


@pytest.fixture
def fake_runs(monkeypatch):
    """Replace the runs by fakes that log their order; the validation run writes a summary."""
    calls = []

    def timing_row(a, arm, link, run_dir, rep):
        calls.append(run_dir.name)
        return _timing(arm) | {"repeat": rep, "median_iter_ms": 100.0 + len(calls), "start": f"t{len(calls)}",
                               "asked": [a.skip, a.steps]}

    def run_segment(cmd, run_dir, timeout_s):
        calls.append("validate")
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(_summary()))
        return True

    monkeypatch.setattr(tta, "timing_row", timing_row)
    monkeypatch.setattr(tta, "_run_segment", run_segment)
    return calls


def test_a_validation_run_is_timed_just_before_and_just_after(tmp_path, fake_runs):
    a = _args(tmp_path)
    assert tta.run_validation(a)
    assert fake_runs == ["sync-100mbit-before-r0", "validate", "sync-100mbit-after-r0"]
    record = json.loads((a.records / "validate-sync-100mbit.json").read_text())
    assert [r["side"] for r in record["bracket"]["before"] + record["bracket"]["after"]] == ["before", "after"]
    # resumable: the run is done and so is its bracket, nothing runs again
    assert tta.run_validation(a) and len(fake_runs) == 3


def test_a_run_validated_without_a_bracket_is_not_given_one_after_the_fact(tmp_path, fake_runs):
    tta.run_validation(_args(tmp_path, validate_bracket=0))
    assert fake_runs == ["validate"]
    tta.run_validation(_args(tmp_path))
    assert fake_runs == ["validate"], "timing taken later is not beside the run"


def test_a_validation_run_that_has_to_run_again_is_bracketed_afresh(tmp_path, fake_runs):
    a = _args(tmp_path)
    stale = {"before": [_timing() | {"side": "before", "start": "old"}], "after": []}
    (a.dir / "validate").mkdir(parents=True)
    tta._bracket_path(a, "sync", "100mbit").write_text(json.dumps(stale))
    tta.run_validation(a)
    record = json.loads((a.records / "validate-sync-100mbit.json").read_text())
    assert [r["start"] for r in record["bracket"]["before"]] == ["t1"]


def _validation_record(tmp_path, bracket):
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    summary = _summary()  # evaluations at steps 150 and 300, the run's own clock 10 s and 20 s
    record = _record("sync", summary) | {"kind": "validate", "link": "100mbit", "steps_limit": 300,
                                         "bracket": bracket}
    (records / "validate-sync-100mbit-300steps.json").write_text(json.dumps(record))
    return records


def test_the_report_composes_a_bracketed_run_against_its_bracket(tmp_path):
    def timed(ms, side):
        return _timing() | {"iter_ms": [ms], "median_iter_ms": ms, "eval_s": 2.0, "side": side}
    records = _validation_record(tmp_path, {"before": [timed(50.0, "before")], "after": [timed(70.0, "after")]})
    a = _args(tmp_path, records=records)
    # the report's own timing says 1 ms/step: a bracketed record does not use it
    links = {"100mbit": {"step_ms": {"sync": 1.0}, "eval_s": 9.0, "unpriced": {}, "warmup_ms": {}}}
    [row] = tta_report._validation(a, links, 90.0, {}, [])
    assert row["timing"] == "bracket" and row["step_ms"] == 60.0
    assert row["composed_s"] == pytest.approx(300 * 0.060 + 2 * 2.0)
    assert (row["composed_before_s"], row["composed_after_s"]) == pytest.approx((300 * 0.05 + 4, 300 * 0.07 + 4))
    assert row["measured_s"] == 20.0 and row["rel_error"] == pytest.approx((22.0 - 20.0) / 20.0)
    # without a bracket it is the report's timing, and it says so
    records = _validation_record(tmp_path, {"before": [], "after": []})
    [row] = tta_report._validation(a, links, 90.0, {}, [])
    assert row["timing"] == "report" and row["composed_s"] == pytest.approx(300 * 0.001 + 2 * 9.0)


def test_a_bracket_of_another_recipe_is_refused(tmp_path):
    other = _timing() | {"side": "before"}
    other["command"] = other["command"].replace("dist.nproc=2", "dist.nproc=2 optimizer.lr=0.5")
    records = _validation_record(tmp_path, {"before": [other], "after": [_timing() | {"side": "after"}]})
    with pytest.raises(tta_report.records.Refused, match="optimizer.lr"):
        tta_report._validation(_args(tmp_path, records=records), {}, 90.0, {}, [])


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_bracket_count_is_named(value, capsys):
    with pytest.raises(SystemExit) as e:
        tta.parse(["--validate-bracket", value])
    assert e.value.code == 2 and "--validate-bracket" in capsys.readouterr().err


def test_a_bracket_times_its_own_window_not_the_studys(tmp_path, fake_runs):
    a = _args(tmp_path, bracket_skip=150, bracket_steps=120)
    tta.run_validation(a)
    bracket = json.loads((a.records / "validate-sync-100mbit.json").read_text())["bracket"]
    assert [r["asked"] for r in bracket["before"] + bracket["after"]] == [[150, 120], [150, 120]], \
        "the study's 40 steps after 10 are start-up"


def test_a_timing_rows_window_is_its_own_or_read_off_its_command():
    assert tta_report.records.timing_window(_timing() | {"window": {"first": 220, "steps": 100, "warmup": [100, 120]}}) \
        == {"first": 220, "steps": 100, "warmup": [100, 120]}
    old = _timing() | {"iter_ms": [1.0] * 40}  # trainer.max_steps=50: the last 40 steps were timed
    assert tta_report.records.timing_window(old) == {"first": 10, "steps": 40, "warmup": None}


@pytest.mark.parametrize("flag", ["--bracket-steps", "--bracket-skip"])
def test_a_bad_bracket_window_is_named(flag, capsys):
    with pytest.raises(SystemExit) as e:
        tta.parse([flag, "-1"])
    assert e.value.code == 2 and f"argument {flag}: must be an integer" in capsys.readouterr().err


def test_the_report_says_which_steps_each_arms_timing_runs_timed():
    old = _timing() | {"iter_ms": [1.0] * 40}
    new = _timing() | {"repeat": 1, "window": {"first": 100, "steps": 100, "warmup": None}}
    block = tta_report.timing_by_link([old, new])["100mbit"]
    assert block["windows"] == {"sync": [{"first": 10, "steps": 40}, {"first": 100, "steps": 100}]}


def test_the_report_judges_the_validations_of_the_folder_it_is_given(tmp_path):
    """--validations: a dated folder of validations beside its timing file, not the records' own."""
    def timed(ms, side):
        return _timing() | {"iter_ms": [ms], "median_iter_ms": ms, "eval_s": 2.0, "side": side}
    records = _validation_record(tmp_path, {"before": [timed(50.0, "before")], "after": [timed(70.0, "after")]})
    dated = tmp_path / "validation-day2"
    dated.mkdir()
    record = json.loads((records / "validate-sync-100mbit-300steps.json").read_text())
    record["bracket"]["before"] = [timed(30.0, "before")]
    (dated / "validate-sync-100mbit-300steps.json").write_text(json.dumps(record))
    [mine] = tta_report._validation(_args(tmp_path, records=records, validations=dated), {}, 90.0, {}, [])
    [theirs] = tta_report._validation(_args(tmp_path, records=records), {}, 90.0, {}, [])
    assert mine["step_ms_before_after"] == [30.0, 70.0] and theirs["step_ms_before_after"] == [50.0, 70.0]
    assert tta_report._validation(_args(tmp_path, records=records, validations=tmp_path / "d"), {}, 90.0, {}, []) == []


def test_a_validations_folder_that_is_not_there_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tta.parse(["--validations", str(tmp_path / "nope")])
    assert e.value.code == 2 and f"--validations: {tmp_path / 'nope'} is not a folder" in capsys.readouterr().err


def test_a_validation_record_holds_its_recipes_metric(tmp_path, monkeypatch):
    # the GPT's curves are validation loss: a validation record of it in accuracy would be judged on
    # the wrong numbers (it was: 17.68, the run's accuracy in %, read as its loss)
    def run_segment(cmd, run_dir, timeout_s):
        run_dir.mkdir(parents=True)
        summary = _summary() | {"test_loss": 2.5}
        summary["evals"] = [{"step": 300, "test_accuracy": 17.7, "test_loss": 2.5, "elapsed_s": 20.0, "eval_s": 1.0}]
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return True

    monkeypatch.setattr(tta, "_run_segment", run_segment)
    a = _args(tmp_path, recipe="gpt_shakespeare", validate_bracket=0)
    assert tta.run_validation(a)
    record = json.loads((a.records / "validate-sync-100mbit.json").read_text())
    assert record["metric"] == "test_loss" and record["curve"] == [[300, 2.5]]
