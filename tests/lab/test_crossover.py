"""The crossover sweep (docs/crossover.md): its grid, the interleaved rounds it runs in,
and the analysis of its bench JSON (best DDP arm, crossover, prediction error, refusals, partial
sweeps), on synthetic records: no processes, no timing."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipesgd_lab.bench import runner
from pipesgd_lab.bench.__main__ import main as bench_main
from pipesgd_lab.bench.crossover import (
    ARMS,
    BEGIN,
    DDP_ARMS,
    END,
    PIPE_ARMS,
    PIPELINED_DDP_ARMS,
    CrossoverError,
    analyse,
    crossover,
    main,
    predict_arms,
    render,
    resnet20_shapes,
    round_calibration,
)
from pipesgd_lab.bench.grid import CROSSOVER_RATES, RESNET20, Cell, crossover_grid
from pipesgd.timing import Link, ddp_buckets, parse_bandwidth
from pipesgd.timing.scale import Scenario, arm_rows

COMMIT = "c" * 40
CONFIG = {"steps": 40, "skip": 10, "repeats": 3, "allreduce_repeats": 20, "quick": False, "threads_per_worker": 1,
          "overrides": [], "cpus": 2, "interleaved": True, "mtu": 9000}


def _calibration(p: int, rate: str) -> dict:
    """A calibration as the bench records it: the link at its nominal rate, ResNet-20's compute here."""
    return {"file": f"/cal/resnet20-p{p}-{rate}.json", "alpha_s": 2e-4, "beta_s_per_byte": 8 / parse_bandwidth(rate),
            "gamma_s_per_byte": 3e-11, "compress_s_per_byte": {"fp16": 1e-10, "int8": 1.2e-9},
            "compute_ms": 100.0 * (p / 2), "update_ms": 1.5, "overlap_slowdown": 1.1}


def _record(p: int, rate: str, arm: str, ms: float, **changes) -> dict:
    mode, _, comp = arm.partition("-")
    return {"name": f"resnet20/p{p}/{rate}/{arm}", "kind": "train", "mode": mode, "compressor": comp or "none",
            "world_size": p, "link": rate, "workload": "resnet20", "commit": COMMIT, "config": dict(CONFIG),
            "date": "2026-11-25T10:00:00+00:00", "loadavg_before": [0.1, 0.1, 0.1], "median_iter_ms": ms,
            "params": RESNET20.params, "calibration": _calibration(p, rate), **changes}


def _sweep(times, ps=(2,)) -> list[dict]:
    """Every cell of the sweep at ``ps``, its median from ``times(p, rate, arm)``."""
    return [_record(p, rate, arm, times(p, rate, arm)) for p in ps for rate in CROSSOVER_RATES for arm in ARMS]


def _predicted(p, rate, arm, factor=1.0):
    return factor * predict_arms(_calibration(p, rate), RESNET20.params, p, SHAPES)[arm]


SHAPES = resnet20_shapes()


# --- the grid -------------------------------------------------------------------------------------------


def test_grid_is_six_rates_by_two_p_by_eleven_arms_with_each_arms_overrides():
    cells = crossover_grid()
    assert len(cells) == 6 * 2 * 11 == len({c.name for c in cells})
    assert {c.link for c in cells} == {"25mbit", "50mbit", "100mbit", "200mbit", "500mbit", "1gbit"}
    assert [parse_bandwidth(r) / 1e6 for r in CROSSOVER_RATES] == [25, 50, 100, 200, 500, 1000]
    assert {c.world_size for c in cells} == {2, 4}
    by_name = {c.name: c for c in cells}
    for p in (2, 4):
        for rate in CROSSOVER_RATES:
            assert {n.rsplit("/", 1)[1] for n in by_name if n.startswith(f"resnet20/p{p}/{rate}/")} == {
                *ARMS, *PIPELINED_DDP_ARMS}
    ov = by_name["resnet20/p2/100mbit/ddp-powersgd"].train_overrides
    assert {"trainer.mode=ddp", "compressor=powersgd", "compressor.rank=2", "compressor.ddp_start_iter=2",
            "trainer.width=1", "dist.nproc=2"} <= set(ov), ov
    assert {"trainer.mode=ddp", "compressor=fp16"} <= set(by_name["resnet20/p4/25mbit/ddp-fp16"].train_overrides)
    assert {"trainer.mode=pipe", "trainer.width=2", "compressor=int8"} <= set(
        by_name["resnet20/p2/1gbit/pipe-int8"].train_overrides)
    assert "trainer.mode=local" in by_name["resnet20/p4/500mbit/local"].train_overrides
    ov = by_name["resnet20/p2/50mbit/ddp-pipelined-powersgd"].train_overrides  # Pipe-SGD inside DDP
    assert {"trainer.mode=ddp", "trainer.width=2", "compressor=powersgd", "compressor.ddp_start_iter=2"} <= set(ov)
    assert {"trainer.mode=ddp", "trainer.width=2", "compressor=none"} <= set(
        by_name["resnet20/p4/25mbit/ddp-pipelined"].train_overrides)
    assert all(c.kind == "train" and c.emulated and c.workload == "resnet20" for c in cells)
    assert not any("compressor.rank" in o for c in cells if c.compressor != "powersgd" for o in c.train_overrides)


def test_bench_cli_lists_the_crossover_grid_and_selects_from_it(capsys):
    assert bench_main(["--grid", "crossover", "--list"]) == 0
    assert len(capsys.readouterr().out.split()) == 132
    assert bench_main(["--grid", "crossover", "--list", "--only", "resnet20/p2/*"]) == 0
    names = capsys.readouterr().out.split()
    assert len(names) == 66 and names[0] == "resnet20/p2/25mbit/local" and "resnet20/p2/1gbit/ddp-powersgd" in names


# --- interleaved rounds ------------------------------------------------------------------------------------


def test_rounds_run_every_cell_once_before_the_next_round(tmp_path, monkeypatch):
    """Round-major order, records pooled over the rounds done so far, a failed cell sits out the rest."""
    order = []

    def fake_repeat(cell, cal, s, r):
        order.append((r, cell.name))
        if cell.name.endswith("/sync") and r == 1:
            raise runner.CellFailed("boom")
        ms = 100.0 + r
        return {"steps": {k: [ms, ms] for k in runner.STEP_FIELDS}, "median": ms, "predicted": 90.0,
                "summary": {"predicted_from": "calibration"}, "cpu": None, "run_dir": f"/r{r}", "command": "cmd",
                "loadavg_before": [float(r), 0.0, 0.0]}

    monkeypatch.setattr(runner, "run_train_repeat", fake_repeat)
    monkeypatch.setattr(runner, "calibration_for", lambda cell, s, cache, tag="": Path("/cal.json"))
    monkeypatch.setattr(runner, "_calibration_summary", lambda path: {"file": str(path)})
    cells = [Cell("train", m, 2, "100mbit", "none", 1) for m in ("local", "sync", "ddp")]
    s = runner.Settings(bench_dir=tmp_path, repeats=3, interleave=True, commit=COMMIT)
    records = list(runner.run_cells(cells, s))
    names = [c.name for c in cells]
    assert order == [(0, n) for n in names] + [(1, n) for n in names] + [(2, names[0]), (2, names[2])]
    last = {r["name"]: r for r in records}
    assert last[names[0]]["repeat_median_iter_ms"] == [100.0, 101.0, 102.0]
    assert last[names[0]]["median_iter_ms"] == 101.0 and last[names[0]]["config"]["rounds_done"] == 3
    assert last[names[0]]["round_loadavg_before"] == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]
    assert last[names[0]]["config"]["interleaved"] is True
    assert "round 2: boom" in last[names[1]]["error"]
    order.clear()
    list(runner.run_cells(cells[:2], runner.Settings(bench_dir=tmp_path, repeats=2, commit=COMMIT)))
    assert order == [(0, names[0]), (1, names[0]), (0, names[1]), (1, names[1])]  # without: cell-major


def test_each_round_calibrates_afresh_and_the_analysis_takes_the_rounds_median(tmp_path, monkeypatch, capsys):
    """--calibrate-each-round: a calibration per condition per round, named by round, each round's
    runs against it; the analysis predicts from each constant's median over the rounds."""
    calibrated, ran = [], []

    def fake_calibration(cell, s, cache, tag=""):
        if cell.calibration_key not in cache:
            calibrated.append((cell.calibration_key, tag))
            cache[cell.calibration_key] = Path(f"/cal{tag}.json")
        return cache[cell.calibration_key]

    def fake_repeat(cell, cal, s, r):
        ran.append((r, str(cal)))
        return {"steps": {k: [100.0] for k in runner.STEP_FIELDS}, "median": 100.0, "predicted": 90.0,
                "summary": {}, "cpu": None, "run_dir": "/r", "command": "cmd", "loadavg_before": [0.0] * 3}

    compute = {"/cal-r0.json": 100.0, "/cal-r1.json": 130.0, "/cal-r2.json": 110.0}
    monkeypatch.setattr(runner, "calibration_for", fake_calibration)
    monkeypatch.setattr(runner, "run_train_repeat", fake_repeat)
    monkeypatch.setattr(runner, "_calibration_summary", lambda path: _calibration(2, "100mbit") | {
        "file": str(path), "compute_ms": compute[str(path)], "powersgd_s_per_flop": compute[str(path)] * 1e-12})
    cells = [Cell("train", m, 2, "100mbit", "none", 1) for m in ("local", "sync")]
    s = runner.Settings(bench_dir=tmp_path, repeats=3, interleave=True, calibrate_each_round=True, commit=COMMIT)
    last = {r["name"]: r for r in runner.run_cells(cells, s)}
    key = cells[0].calibration_key
    assert calibrated == [(key, "-r0"), (key, "-r1"), (key, "-r2")]
    assert ran == [(r, f"/cal-r{r}.json") for r in range(3) for _ in cells]
    record = last[cells[0].name]
    assert [c["file"] for c in record["round_calibrations"]] == ["/cal-r0.json", "/cal-r1.json", "/cal-r2.json"]
    assert record["config"]["calibrate_each_round"] is True
    merged = round_calibration(record)
    assert merged["compute_ms"] == 110.0 and merged["powersgd_s_per_flop"] == pytest.approx(110e-12)
    assert merged["rounds"] == 3
    assert round_calibration({"calibration": {"compute_ms": 5.0}}) == {"compute_ms": 5.0}
    with pytest.raises(SystemExit):
        bench_main(["--grid", "full", "--only", "resnet20/p2/100mbit/sync", "--calibrate-each-round", "--list"])
    assert "--calibrate-each-round: needs rounds" in capsys.readouterr().err


def test_the_analysis_prices_powersgds_compute_from_the_calibration():
    plain = predict_arms(_calibration(2, "100mbit"), RESNET20.params, 2, SHAPES)
    priced = predict_arms(_calibration(2, "100mbit") | {"powersgd_s_per_flop": 1e-9}, RESNET20.params, 2, SHAPES)
    assert priced["ddp-powersgd"] > plain["ddp-powersgd"]
    assert {a: ms for a, ms in priced.items() if a != "ddp-powersgd"} == \
        {a: ms for a, ms in plain.items() if a != "ddp-powersgd"}
    records = [{**r, "calibration": r["calibration"] | {"powersgd_s_per_flop": 1e-9}} for r in _sweep(_predicted)]
    assert analyse(records, SHAPES)["powersgd_compute"].startswith("its declared FLOPs")
    assert analyse(_sweep(_predicted), SHAPES)["powersgd_compute"].startswith("NOT MODELLED")


def test_the_analysis_prices_each_barrier_a_step_waits_at():
    cal = _calibration(2, "100mbit")
    plain = predict_arms(cal, RESNET20.params, 2, SHAPES, buffers=True)
    priced = predict_arms(cal | {"barrier_s": 0.005}, RESNET20.params, 2, SHAPES, buffers=True)
    # ResNet-20 has BatchNorm statistics: DDP waits at forward's broadcast and backward's buckets,
    # sync at its reduction, pipe at the buffers' broadcast of its step; compute alone at nothing
    assert priced["ddp"] - plain["ddp"] == pytest.approx(10.0)
    assert priced["ddp-powersgd"] - plain["ddp-powersgd"] == pytest.approx(10.0)
    assert priced["sync"] - plain["sync"] == pytest.approx(5.0)
    assert priced["pipe-int8"] - plain["pipe-int8"] == pytest.approx(5.0)
    assert priced["local"] == plain["local"]
    without = predict_arms(cal | {"barrier_s": 0.005}, RESNET20.params, 2, SHAPES, buffers=False)
    assert without["ddp"] - plain["ddp"] == pytest.approx(5.0) and without["pipe-int8"] == plain["pipe-int8"]
    records = [{**r, "calibration": r["calibration"] | {"barrier_s": 0.005}} for r in _sweep(_predicted)]
    assert analyse(records, SHAPES, buffers=True)["barriers"].startswith("each blocking collective")
    assert analyse(_sweep(_predicted), SHAPES)["barriers"].startswith("NOT MODELLED")


# --- the analysis -------------------------------------------------------------------------------------------


def test_predictions_are_the_maps_and_ddp_powersgd_is_one_gloo_bucket():
    cal = _calibration(2, "100mbit")
    got = predict_arms(cal, RESNET20.params, 2, SHAPES)
    assert set(got) == set(ARMS)
    assert got["local"] == cal["compute_ms"] + cal["update_ms"]
    link = Link(cal["alpha_s"], cal["beta_s_per_byte"], cal["gamma_s_per_byte"])
    base = Scenario(RESNET20.params, 2, link, cal["compute_ms"] / 1e3, update_s=cal["update_ms"] / 1e3, shapes=SHAPES,
                    overlap_slowdown=cal["overlap_slowdown"], compress_s_per_byte=cal["compress_s_per_byte"])
    rows = {r["arm"]: r["iter_ms"] for r in arm_rows(base)}
    for arm in ("sync", "ddp", "ddp-fp16", *PIPE_ARMS):
        assert got[arm] == rows[arm]
    # ResNet-20 (1.08 MB) is over DDP's 1 MiB first bucket: the default map prices two buckets of
    # three allreduces; the mode puts everything in one bucket on Gloo, which the prediction follows.
    assert ddp_buckets(4 * RESNET20.params) == [2**20, 4 * RESNET20.params - 2**20]
    one = 4 * RESNET20.params + 2**20
    one_bucket = arm_rows(replace(base, bucket_cap_bytes=one, first_bucket_bytes=one), ["ddp-powersgd"])[0]
    assert got["ddp-powersgd"] == one_bucket["iter_ms"] != rows["ddp-powersgd"]
    assert got["ddp-powersgd"] < got["ddp"]  # PowerSGD sends far fewer bytes than fp32 at 100 Mbit/s


def test_best_ddp_arm_is_the_fastest_measured_one_per_rate():
    fast = {"25mbit": "ddp-powersgd", "1gbit": "ddp", "100mbit": "ddp-fp16"}

    def times(p, rate, arm):
        if arm in DDP_ARMS:
            return 150.0 if fast.get(rate, "ddp") == arm else 200.0
        return 300.0

    result = analyse(_sweep(times), SHAPES)
    best = {r["link"]: r["measured"]["best_ddp"] for r in result["rows"]}
    for rate, arm in fast.items():
        assert best[rate] == {"arm": arm, "ms": 150.0}
    row = next(r for r in result["rows"] if r["link"] == "25mbit")
    assert row["measured"]["speedup"] == {a: 0.5 for a in PIPE_ARMS}
    assert row["predicted"]["best_ddp"]["arm"] in DDP_ARMS


def test_crossover_is_the_first_winning_rate_from_the_fastest_link_down():
    # pipe-int8 wins by 10 % at 100 Mbit/s and below, by 3 % (not enough) at 200, ties above.
    gain = {"25mbit": 1.3, "50mbit": 1.2, "100mbit": 1.1, "200mbit": 1.03, "500mbit": 1.0, "1gbit": 1.0}

    def times(p, rate, arm):
        return 200.0 / gain[rate] if arm == "pipe-int8" else 200.0

    result = analyse(_sweep(times), SHAPES)
    c = result["crossover"]["2"]["measured"]
    assert (c["rate"], c["arm"], c["index"], c["uncertain"]) == ("100mbit", "pipe-int8", 2, False)
    assert [r["measured"]["winner"] for r in result["rows"]] == ["pipe-int8"] * 3 + [None] * 3


def test_no_crossover_when_no_pipe_arm_wins_by_five_percent():
    result = analyse(_sweep(lambda p, rate, arm: 200.0 if arm in PIPE_ARMS else 205.0), SHAPES)
    assert result["crossover"]["2"]["measured"] == {"rate": None, "arm": None, "index": None, "uncertain": False}


def test_crossover_agreement_is_same_rate_or_one_sweep_step():
    def rows(meas_from: int, pred_from: int) -> list[dict]:
        out = []
        for i, rate in enumerate(CROSSOVER_RATES):
            def side(won):
                return {"best_ddp": {"arm": "ddp", "ms": 1.0}, "speedup": {a: 1.0 for a in PIPE_ARMS},
                        "winner": "pipe" if won else None}
            out.append({"link": rate, "rate_mbit": parse_bandwidth(rate) / 1e6,
                        "measured": side(i <= meas_from), "predicted": side(i <= pred_from)})
        return out

    assert crossover(rows(2, 3), "measured")["rate"] == "100mbit"
    assert crossover(rows(2, 3), "predicted")["rate"] == "200mbit"
    assert crossover(rows(-1, 0), "measured")["rate"] is None


def test_prediction_error_is_the_median_over_every_measured_cell():
    result = analyse(_sweep(lambda p, rate, arm: _predicted(p, rate, arm, 1 / 1.25)), SHAPES)
    assert result["cells_predicted"] == 48
    assert result["median_abs_error"] == pytest.approx(0.25)
    exact = analyse(_sweep(_predicted), SHAPES)
    assert exact["median_abs_error"] == pytest.approx(0.0, abs=1e-12)
    c = exact["crossover"]["2"]
    assert c["measured"] == c["predicted"] and c["agree"] and c["steps_apart"] == 0


def test_a_win_that_one_round_does_not_show_is_flagged_but_still_the_stated_rules():
    """Pooled, pipe wins by 10 % at 100 Mbit/s and below; in round 2 at 100 Mbit/s it ties. The
    stated crossover stays 100 Mbit/s; the every-round reading moves it to 50, and the table shows
    each round's speedup."""
    gain = {"25mbit": 1.3, "50mbit": 1.2, "100mbit": 1.1}

    def record(p, rate, arm):
        ms = 200.0 / gain.get(rate, 1.0) if arm == "pipe" else 200.0
        rounds = [ms, 200.0 if (rate, arm) == ("100mbit", "pipe") else ms, ms]
        return _record(p, rate, arm, ms, repeat_median_iter_ms=rounds)

    result = analyse([record(2, rate, arm) for rate in CROSSOVER_RATES for arm in ARMS], SHAPES)
    c = result["crossover"]["2"]
    assert c["measured"]["rate"] == "100mbit" and c["measured_every_round"]["rate"] == "50mbit"
    row = next(r for r in result["rows"] if r["link"] == "100mbit")
    assert row["measured_every_round"]["rounds"]["pipe"] == pytest.approx([1.1, 1.0, 1.1])
    assert row["measured_every_round"]["winner"] is None and row["measured"]["winner"] == "pipe"
    assert "1.10 (1.00–1.10) / " in render(result)
    no_rounds = analyse(_sweep(_predicted), SHAPES)["crossover"]["2"]["measured_every_round"]
    assert no_rounds["rate"] is None and no_rounds["uncertain"], "records without rounds decide nothing"


def test_the_model_fed_the_local_cells_compute_is_reported_beside_the_calibrated_one():
    """Every arm measured exactly as the model predicts with compute 20 % above the calibration's:
    the calibrated prediction is off, the one fed the local cell's measured compute is exact."""
    def slower(p, rate):
        cal = _calibration(p, rate)
        return cal | {"compute_ms": 1.2 * cal["compute_ms"]}

    records = [_record(2, rate, arm, predict_arms(slower(2, rate), RESNET20.params, 2, SHAPES)[arm])
               for rate in CROSSOVER_RATES for arm in ARMS]
    result = analyse(records, SHAPES)
    assert result["median_abs_error"] > 0.05
    assert result["median_abs_error_local_compute"] == pytest.approx(0.0, abs=1e-9)
    assert result["cells_predicted_local_compute"] == 42, "the local cell itself is its own input"
    assert "(not a goal) the same model" in render(result)


def test_partial_sweep_reports_missing_cells_and_strict_refuses_them():
    records = [r for r in _sweep(_predicted, ps=(2, 4)) if r["name"] not in
               ("resnet20/p2/500mbit/ddp-powersgd", "resnet20/p4/25mbit/local")]
    records.append({**_record(4, "50mbit", "pipe", 1.0), "error": "exit status 1", "median_iter_ms": None})
    records = [r for r in records if not (r["name"] == "resnet20/p4/50mbit/pipe" and "error" not in r)]
    result = analyse(records, SHAPES)
    assert set(result["missing"]) == {"resnet20/p2/500mbit/ddp-powersgd", "resnet20/p4/25mbit/local",
                                      "resnet20/p4/50mbit/pipe"}
    assert result["missing"]["resnet20/p4/50mbit/pipe"] == "exit status 1"
    assert result["missing"]["resnet20/p2/500mbit/ddp-powersgd"] == "not run"
    row = next(r for r in result["rows"] if (r["p"], r["link"]) == (2, "500mbit"))
    assert row["missing"] == ["ddp-powersgd"] and row["measured"]["best_ddp"] is None
    assert row["predicted"]["best_ddp"] is not None  # the calibration still predicts the row
    row = next(r for r in result["rows"] if (r["p"], r["link"]) == (4, "25mbit"))
    assert row["compute_from"].startswith("calibration")
    with pytest.raises(CrossoverError, match="resnet20/p2/500mbit/ddp-powersgd: not run"):
        analyse(records, SHAPES, strict=True)
    only_p2 = analyse([r for r in records if r["world_size"] == 2], SHAPES)
    assert only_p2["world_sizes"] == [2] and list(only_p2["missing"]) == ["resnet20/p2/500mbit/ddp-powersgd"]


def test_a_missing_faster_rate_makes_the_crossover_uncertain():
    gain = {"25mbit": 1.3, "50mbit": 1.2, "100mbit": 1.1}
    records = [r for r in _sweep(lambda p, rate, arm: 200.0 / gain.get(rate, 1.0) if arm == "pipe" else 200.0)
               if r["name"] != "resnet20/p2/200mbit/ddp"]
    result = analyse(records, SHAPES)
    c = result["crossover"]["2"]
    assert c["measured"]["rate"] == "100mbit" and c["measured"]["uncertain"] and not c["agree"]


def test_mixed_commits_or_settings_are_refused_naming_them():
    records = _sweep(_predicted)
    records[3] = {**records[3], "commit": "d" * 40}
    with pytest.raises(CrossoverError, match=f"2 commits.*{'d' * 40}: 1 cells \\({records[3]['name']}"):
        analyse(records, SHAPES)
    records = _sweep(_predicted)
    records[5] = {**records[5], "config": {**CONFIG, "steps": 20}}
    with pytest.raises(CrossoverError, match="2 different bench settings.*\"steps\": 20"):
        analyse(records, SHAPES)
    records = [{**r, "host": {"cpu_model": "Xeon A", "cpu_capability": "AVX512"}} for r in _sweep(_predicted)]
    assert analyse(records, SHAPES)["host_kind"].startswith("Xeon A | AVX512")
    records[2] = {**records[2], "host": {"cpu_model": "EPYC B", "cpu_capability": "AVX2"}}
    with pytest.raises(CrossoverError, match=f"2 kinds of host.*EPYC B.*: 1 cells \\({records[2]['name']}"):
        analyse(records, SHAPES)
    with pytest.raises(CrossoverError, match="no crossover cells"):
        analyse([{**_record(2, "100mbit", "pipe", 1.0), "name": "resnet20/p2/loopback/pipe"}], SHAPES)


def test_cli_writes_plot_markdown_and_json_and_refuses_bad_input(tmp_path, capsys):
    gain = {"25mbit": 1.3, "50mbit": 1.2, "100mbit": 1.1}
    records = [r for r in _sweep(lambda p, rate, arm: _predicted(p, rate, arm) / (gain.get(rate, 1.0)
                                                                               if arm == "pipe-int8" else 1.0),
                                 ps=(2, 4)) if r["name"] != "resnet20/p4/1gbit/sync"]
    data, md, png = tmp_path / "crossover.json", tmp_path / "crossover.md", tmp_path / "img/c.png"
    out = tmp_path / "a.json"
    data.write_text(json.dumps(records))
    md.write_text("# Crossover\n\nbefore\n\n" + BEGIN + "\nold\n" + END + "\n\nafter\n")
    assert main(["--in", str(data), "--plot", str(png), "--md", str(md), "--json", str(out)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = md.read_text()
    assert "before" in text and "after" in text and "\nold\n" not in text and text.count(BEGIN) == 1
    assert "](img/c.png)" in text and "| resnet20/p4/1gbit/sync | not run |" in text
    result = json.loads(out.read_text())
    assert result["crossover"]["2"]["measured"]["rate"] == "100mbit"
    assert math.isfinite(result["median_abs_error"])
    assert "1 cells missing" in capsys.readouterr().out
    assert main(["--in", str(data), "--strict"]) == 2
    assert "resnet20/p4/1gbit/sync: not run" in capsys.readouterr().err


def test_every_cells_overrides_validate_and_run_the_papers_rule():
    """The bench's cells on top of their experiment file (resnet_cifar sets staleness=lookahead):
    ddp and local must not be refused for a rule they do not use, and pipe runs the paper's rule."""
    from hydra import compose, initialize_config_dir

    import pipesgd.schema  # noqa: F401  (registers the structured config)
    from pipesgd_lab.bench.grid import WORKLOADS, full_grid
    from pipesgd.config import command_line_keys, validate

    root = Path(__file__).resolve().parents[2]
    cells = {(c.workload, c.mode, c.compressor): c for c in [*crossover_grid(), *full_grid()]
             if c.kind == "train" and c.comm == "ring"}
    for cell in cells.values():
        overrides = [*WORKLOADS[cell.workload].train_overrides, *cell.train_overrides]
        with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        assert validate(cfg, command_line_keys(overrides)).staleness == "none", cell.name


def test_the_documented_commands_select_the_sweep_and_parse(capsys):
    """docs/crossover.md's commands for the lead: the two bench invocations select p = 2 and p = 4
    (66 cells each: 8 arms and 3 of pipelined DDP at 6 rates) and the analysis' flags exist."""
    import shlex

    from pipesgd_lab.bench.crossover import build_parser

    text = (Path(__file__).resolve().parents[2] / "docs/crossover.md").read_text()
    commands = [shlex.split(line) for line in text.splitlines() if line.startswith("python -m pipesgd_lab.bench")]
    bench = [c[3:] for c in commands if c[2] == "pipesgd_lab.bench"]
    assert len(bench) == 2
    for argv, p in zip(bench, (2, 4)):
        assert bench_main([*argv, "--list"]) == 0
        names = capsys.readouterr().out.split()
        assert len(names) == 66 and all(n.startswith(f"resnet20/p{p}/") for n in names)
    (analysis,) = [c[3:] for c in commands if c[2] == "pipesgd_lab.bench.crossover"]
    args = build_parser().parse_args(analysis)
    assert args.strict and args.plot == Path("docs/img/crossover.png") and args.md == Path("docs/crossover.md")


def test_pipelined_ddp_arms_are_measured_beside_the_pipe_arms_and_left_out_of_the_prediction():
    records = _sweep(lambda p, rate, arm: 200.0)
    for rate in CROSSOVER_RATES:
        for comp, arm in zip(("none", "fp16", "powersgd"), PIPELINED_DDP_ARMS):
            records.append(_record(2, rate, "ddp", 100.0 if comp == "powersgd" else 250.0, compressor=comp, width=2,
                                   name=f"resnet20/p2/{rate}/{arm}"))
    result = analyse(records, SHAPES, strict=True)
    for row in result["rows"]:
        assert row["pipelined_ddp"]["ddp-pipelined-powersgd"] == {"ms": 100.0, "speedup": 2.0}
        assert row["pipelined_ddp"]["ddp-pipelined"]["speedup"] == 200.0 / 250.0
    assert analyse(_sweep(lambda p, rate, arm: 200.0), SHAPES, strict=True)["rows"][0]["pipelined_ddp"][
        "ddp-pipelined"] == {"ms": None, "speedup": None}, "not measured yet: reported as such, not missing"
