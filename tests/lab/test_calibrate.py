"""``python -m pipesgd_lab.bench.calibrate_cli``: a real run on 2 Gloo ranks whose file ``predict`` and
training runs then read (the fit by hand: tests/lab/test_calibrate_fit.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipesgd.timing import MODEL_PARAMS, load_calibration, load_timing_model
from pipesgd.timing.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_calibrate_on_two_gloo_ranks(tmp_path, capsys):
    out = tmp_path / "cal.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.bench.calibrate_cli", "--workers", "2", "--model", "mlp",
                        "--batch-size", "8", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(out)
    cal = load_calibration(out)
    # Sane, not exact (a shared machine): loopback latency under 50 ms, bandwidth above 10 Mbit/s.
    assert 0 < cal["alpha_s"] < 0.05
    assert 0 < cal["beta_s_per_byte"] < 8e-7
    assert cal["gamma_s_per_byte"] > 0 and cal["compute_ms"] > 0 and cal["update_ms"] > 0
    assert set(cal["compress_s_per_byte"]) == {"fp16", "bf16", "int8"}
    assert all(v > 0 for v in cal["compress_s_per_byte"].values())
    assert cal["overlap_slowdown"] >= 1
    # a step that ends at an allreduce of one value waits for the slower rank: >= 0, and each
    # rank's synced step was measured
    assert cal["barrier_s"] >= 0 and cal["barrier_s"] == max(0.0, cal["measurements"]["barrier_s_raw"])
    assert all(r["synced_compute_ms"] > 0 for r in cal["measurements"]["per_rank"])
    # PowerSGD's compute per declared FLOP on the model's own shapes (the MLP's three weight matrices)
    assert cal["powersgd_s_per_flop"] > 0 and cal["powersgd_step_ms"] > 0 and cal["powersgd_rank"] == 2
    assert (cal["model_params"], cal["batch_size"], cal["workers"]) == (MODEL_PARAMS["mlp"], 8, 2)
    m = cal["measurements"]
    assert len(m["one_way_s"]) == len(m["sizes_bytes"]) == 3 and len(m["per_rank"]) == 2

    # predict reads it; a training run of that model and batch would predict from its compute.
    assert main(["predict", "--model", "mlp", "--workers", "2", "--calibration", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    sync = next(r for r in rows if (r["mode"], r["algorithm"], r["compressor"]) == ("sync", "ring", "none"))
    assert sync["iter_ms"] > cal["compute_ms"]
    timing = load_timing_model(calibration=str(out))
    assert timing.calibrated_compute(MODEL_PARAMS["mlp"], 8).compute_s == pytest.approx(cal["compute_ms"] / 1e3)
    assert timing.calibrated_compute(MODEL_PARAMS["mlp"], 64) is None
