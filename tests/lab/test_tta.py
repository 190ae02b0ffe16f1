"""The time-to-accuracy study end to end: a 2-arm miniature (MNIST, a couple of hundred steps) run
through the CLI writes its JSON, plot and records, and a second call resumes (its arithmetic:
tests/lab/test_tta_arithmetic.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runs import CACHE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_arm_miniature_writes_json_and_plot(tmp_path, shared_data):
    out, png = tmp_path / "tta.json", tmp_path / "tta.png"
    cmd = [sys.executable, "-m", "pipesgd_lab.bench.tta", "--recipe", "mnist_mlp", "--arms", "sync,pipe+lookahead",
           "--links", "loopback", "--repeats", "1", "--steps", "10", "--skip", "3", "--bracket-steps", "12",
           "--bracket-skip", "5", "--probe-s", "0.1", "--dir", str(tmp_path / "d"),
           "--json", str(out), "--plot", str(png), "--records", str(tmp_path / "records"), f"data.root={shared_data}", f"data.cache_dir={CACHE}",
           "trainer.max_steps=120", "trainer.eval_every_steps=30", "dist.threads_per_worker=1"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"recipe", "target_accuracy", "arms", "links", "validation", "commit", "date"} <= result.keys()
    sync = next(a for a in result["arms"] if a["name"] == "sync")
    assert result["target_accuracy"] == pytest.approx(sync["final_test_accuracy"] - 0.3)
    assert [p[0] for p in sync["curve"]] == [30, 60, 90, 120] and sync["final_test_accuracy"] > 80
    block = result["links"]["loopback"]
    assert set(block["step_ms"]) == {"sync", "pipe+lookahead", "compute"} and block["eval_s"] > 0
    assert block["ceiling"]["compute_ms"] == block["step_ms"]["compute"]
    rows = json.loads((tmp_path / "d" / "timing.json").read_text())
    assert all(r["host_speed"]["before"]["gflops"] > 0 < r["host_speed"]["after"]["gflops"] for r in rows)
    assert block["timing_host_speed"]["runs"] == len(rows) == 3 and "host speed on loopback: median" in r.stdout
    written = {p.name for p in (tmp_path / "records").iterdir()}
    assert {"sync-s0.json", "pipe+lookahead-s0.json", "validate-sync-loopback.json"} <= written
    assert all(r["segments"] and r["segments"][0]["commit"] for r in result["arms"])
    assert {v["arm"] for v in result["validation"]} == {"sync", "pipe+lookahead"}
    assert all(v["same_curve_as_loopback"] for v in result["validation"]), "fixed staleness: the same curve"
    assert all(v["timing"] == "bracket" and v["composed_before_s"] > 0 for v in result["validation"])
    # the bracket timed its own window: 12 steps after 5 (a pipe arm after its timed warm-up too)
    assert {v["arm"]: v["window"]["first"] for v in result["validation"]} == {"sync": 5, "pipe+lookahead": 30}
    assert all(v["window"]["steps"] == 12 for v in result["validation"])
    assert png.stat().st_size > 10_000 and "| pipe+lookahead | 1 |" in r.stdout
    # resumable: a second call finds every run done and only re-reports
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "curve sync seed 0: done" in again.stderr and "$ python" not in again.stderr
