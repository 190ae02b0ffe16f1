"""The time-to-target study with a lower-is-better target (a language model's validation
loss): which evaluation reaches the target, the headline target from sync's finals, the margins,
the composed times and the curve records, on small synthetic data."""

import pytest

from pipesgd_lab.bench import tta_compose as compose
from pipesgd_lab.bench import tta_records as records
from pipesgd_lab.bench.tta_arms import ARMS, metric_for

CURVE = [[100, 3.0], [200, 2.0], [300, 1.9]]


def test_a_loss_target_is_reached_from_above_and_accuracy_from_below():
    assert compose.steps_to(CURVE, 2.02, compose.LOSS) == (200, 2)
    assert compose.steps_to(CURVE, 1.8, compose.LOSS) is None
    assert compose.steps_to(CURVE, 2.02) == (100, 1), "accuracy (the default) counts values at or above"
    margins = compose.crossings(CURVE, {"target": 2.02}, compose.LOSS)
    assert margins["target"] == {"step": 200, "margin_pp": pytest.approx(0.02)}


def test_the_loss_target_is_syncs_mean_final_plus_one_percent():
    targets = compose.LOSS.targets([2.0, 2.2])
    assert targets["target"] == pytest.approx(2.1 * 1.01)
    assert sorted(targets) == ["slack 0.5 %", "slack 1 %", "slack 2 %", "target"]
    assert compose.ACCURACY.targets([90.0])["target"] == pytest.approx(90.0 - compose.SAME_ACCURACY_PP)
    with pytest.raises(ValueError, match="no finished 'sync' run"):
        compose.LOSS.targets([])


def test_composed_time_to_loss_and_speedup():
    runs = [{"name": "sync", "seed": 0, "curve": CURVE}, {"name": "pipe", "seed": 0, "curve": [[100, 2.5], [200, 2.1],
                                                                                           [300, 2.0]]}]
    block = compose.compose_link(runs, {"sync": 100.0, "pipe": 50.0}, eval_s=1.0, warmup={}, targets=2.02,
                                 metric=compose.LOSS)
    times = block["time_to_target_s"]
    assert times["sync"] == pytest.approx(200 * 0.1 + 2 * 1.0)
    assert times["pipe"] == pytest.approx(300 * 0.05 + 3 * 1.0)
    assert block["speedup"]["sync"]["pipe"] == pytest.approx(22.0 / 18.0)


def test_a_curve_record_keeps_the_recipes_metric():
    assert metric_for("gpt_shakespeare") is compose.LOSS and metric_for("resnet_cifar_tta") is compose.ACCURACY
    summary = {"steps": 300, "total_steps": 300, "world_size": 2, "test_accuracy": 0.5, "test_loss": 1.9,
               "mode": "sync", "width": 1, "staleness": "none", "compressor": "none",
               "evals": [{"step": 150, "test_loss": 2.4, "test_accuracy": 0.4}, {"step": 300, "test_loss": 1.9,
                                                                                 "test_accuracy": 0.5}],
               "config": {"seed": 0, "trainer": {"mode": "sync", "width": 1, "staleness": "none"},
                          "compressor": {"_target_": "pipesgd.compress.none.NoCompression"}}}
    rec = records.curve_record("sync", 0, ARMS["sync"], "gpt_shakespeare", summary, [], metric=compose.LOSS)
    assert rec["metric"] == "test_loss" and rec["final_test_loss"] == 1.9
    assert rec["curve"] == [[150, 2.4], [300, 1.9]] and "final_test_accuracy" not in rec
    acc = records.curve_record("sync", 0, ARMS["sync"], "resnet_cifar_tta", summary, [])
    assert acc["final_test_accuracy"] == 50.0 and acc["curve"] == [[150, 40.0], [300, 50.0]]


def test_another_recipes_study_writes_its_own_result_never_the_resnet_studys():
    from pipesgd_lab.bench.tta import parse

    gpt = parse(["--recipe", "gpt_shakespeare", "--phase", "report"])
    assert gpt.json.name == "time-to-target-gpt_shakespeare.json" and gpt.plot.name == "time-to-target-gpt_shakespeare.png"
    resnet = parse(["--phase", "report"])
    assert resnet.json.name == "time-to-accuracy.json" and resnet.plot.name == "time-to-accuracy.png"
    assert parse(["--phase", "report", "--json", "x.json", "--plot", ""]).json.name == "x.json"


def test_a_report_without_timing_plots_the_loss_against_the_step(tmp_path):
    """The committed GPT curves (results/gpt-shakespeare/runs/) before any timing exists: the report
    still writes its JSON (target: sync's final + 1 %) and a plot against the step."""
    import json
    from pathlib import Path

    from pipesgd_lab.bench.tta import main

    runs = Path(__file__).resolve().parents[2] / "results" / "gpt-shakespeare" / "runs"
    out, png = tmp_path / "gpt.json", tmp_path / "img" / "gpt.png"
    assert main(["--recipe", "gpt_shakespeare", "--phase", "report", "--records", str(runs), "--seeds", "0",
                 "--arms", "sync,pipe+lookahead", "--dir", str(tmp_path / "none"), "--json", str(out),
                 "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    sync = json.loads((runs / "sync-s0.json").read_text())["final_test_loss"]
    assert result["metric"]["key"] == "test_loss" and result["links"] == {}
    assert result["target_accuracy"] == pytest.approx(sync * 1.01)
    assert png.stat().st_size > 10_000
    # the goals judge the loss by its own rule: pipe + lookahead within 1 % of sync (relative)
    lookahead = json.loads((runs / "pipe+lookahead-s0.json").read_text())["final_test_loss"]
    goal = next(g for g in result["goals"] if g["goal"] == "loss pipe+lookahead")
    assert goal["value"] == pytest.approx(lookahead / sync - 1) and goal["met"] == (lookahead <= sync * 1.01)
    assert [g["goal"] for g in result["goals"] if g["goal"].startswith("speed")] == ["speed 50mbit"]
    assert not any(g["goal"].startswith("accuracy") for g in result["goals"])


def test_the_loss_studys_table_and_goals_speak_its_metric():
    runs = [{"name": "sync", "seed": 0, "complete": True, "curve": CURVE, "final_test_loss": 1.9},
            {"name": "sync", "seed": 1, "complete": True, "curve": CURVE, "final_test_loss": 2.1},
            {"name": "pipe+lookahead-int8", "seed": 0, "complete": True, "curve": CURVE, "final_test_loss": 2.03}]
    result = {"metric": {"key": "test_loss", "lower_is_better": True, "unit": "nats"}, "target_accuracy": 2.02,
              "arms": runs, "links": {}, "targets": {"target": 2.02}}
    table = compose.table(result)
    assert "final test loss" in table and "| sync | 2 | 2.0000 ± 0.1000 | 200 |" in table, table
    goals = {g["goal"]: g for g in compose.goals(result)}
    assert goals["loss pipe+lookahead-int8"]["value"] == pytest.approx(0.015)
    assert goals["loss pipe+lookahead-int8"]["met"] is False  # 1.5 % above sync's mean: not the same loss
    assert goals["loss pipe+lookahead"]["met"] is None
    assert "+1.50 % vs sync" in compose.goals_table(list(goals.values()))


@pytest.mark.parametrize("timed", [False, True])
def test_both_plots_label_the_loss_and_its_target_in_nats(timed, monkeypatch, tmp_path):
    """The wall-clock plot (a study with timing) once labelled every metric "test accuracy %"."""
    from matplotlib.figure import Figure

    from pipesgd_lab.bench import tta_report

    made = []

    def figure(width, height):
        made.append(Figure(figsize=(width, height)))
        return made[-1]

    monkeypatch.setattr("pipesgd_lab.report.figure.new_figure", figure)
    run = {"name": "sync", "seed": 0, "complete": True, "curve": [[0, 5.5], *CURVE]}
    result = {"metric": {"key": "test_loss", "lower_is_better": True, "unit": "nats"}, "target_accuracy": 1.919,
              "arms": [run], "warmup": {},
              "links": {"50mbit": {"step_ms": {"sync": 100.0}, "eval_s": 1.0, "warmup_ms": {}, "unpriced": []}}}
    (tta_report.plot if timed else tta_report.plot_steps)(result, tmp_path / "p.png")
    ax = made[0].axes[0]
    assert ax.get_ylabel() == "test loss (nats)"
    assert [t.get_text() for t in ax.texts] == ["target 1.919 nats"]
    low, high = ax.get_ylim()
    assert low < 1.9 < high < 5.5, "the end of the curves is shown, not the first evaluation's loss"
