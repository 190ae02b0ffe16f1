"""What users look at, from one real 2-job multirun (sync and pipe, traced) made by
examples/sweep.sh: the trace-event JSON, the timeline PNG, the TensorBoard events read back with
TensorBoard's own reader, and the sweep report. The module shares the one multirun (~2 x 15 s on
a quiet machine) to keep the suite fast."""

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from runs import ROOT, fast

from pipesgd_lab.report import ReportError, sweep_report
from pipesgd.observability.trace import CATEGORIES

STEPS = 12


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, request):
    data = Path(__file__).resolve().parents[3] / "shared" / "data"
    if not (data / "mnist").is_dir():
        pytest.skip(f"offline datasets not found at {data}")
    tmp = tmp_path_factory.mktemp("obs")
    out = tmp / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHON=sys.executable)
    r = subprocess.run(["bash", "examples/sweep.sh", str(out), "+experiment=mnist_mlp", *fast(tmp, data),
                        f"trainer.max_steps={STEPS}", "trainer.mode=sync,pipe", "trainer.trace=true"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("| job | mode | width | compressor |"), "sweep.sh ends with the report"
    return out


def jobs(sweep: Path) -> dict[str, Path]:
    return {json.loads((d / "summary.json").read_text())["mode"]: d for d in sorted(sweep.iterdir())
            if (d / "summary.json").exists()}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def overlap_ms(a: list[dict], b: list[dict]) -> float:
    """Total time (ms) during which a span of ``a`` and a span of ``b`` both run."""
    return sum(max(0.0, min(x["ts"] + x["dur"], y["ts"] + y["dur"]) - max(x["ts"], y["ts"]))
               for x in a for y in b) / 1e3


@pytest.mark.timeout(300)
def test_trace_is_valid_trace_event_json_with_disjoint_spans_per_thread(sweep):
    for mode, job in jobs(sweep).items():
        doc = json.loads((job / "trace.json").read_text())
        events = doc["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        meta = [e for e in events if e["ph"] == "M"]
        assert {e["ph"] for e in events} == {"X", "M"}
        for e in spans:
            assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
            assert e["cat"] in CATEGORIES and e["ts"] >= 0 and e["dur"] >= 0
            assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        tracks = {(e["pid"], e["tid"]) for e in spans}
        assert {pid for pid, _ in tracks} == {0, 1}, "one process per rank"
        named = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
        assert tracks <= named and {e["pid"] for e in meta if e["name"] == "process_name"} == {0, 1}
        for track in tracks:
            seq = sorted((e for e in spans if (e["pid"], e["tid"]) == track), key=lambda e: e["ts"])
            for a, b in zip(seq, seq[1:]):
                assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, f"{mode} {track}: {a} overlaps {b}"
        for rank in (0, 1):
            main = [e for e in spans if e["pid"] == rank and e["tid"] == 0]
            assert sorted(e["args"]["step"] for e in main if e["name"] == "forward") == list(range(STEPS))
            comm = [e for e in spans if e["pid"] == rank and e["tid"] != 0]
            assert {"reduce-scatter", "allgather", "encode", "decode+add", "average"} <= {e["name"] for e in comm}
            compute = [e for e in main if e["cat"] == "compute"]
            hidden = overlap_ms([e for e in comm if e["cat"] == "comm"], compute)
            # Width 1 waits for each reduction before the next forward; width 2 runs it under one.
            assert hidden == 0.0 if mode == "sync" else hidden > 0.0, (mode, rank, hidden)


@pytest.mark.timeout(300)
def test_timeline_png_renders(sweep):
    job = jobs(sweep)["pipe"]
    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.report", "timeline", str(job), "--steps", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    width, height = png_size(job / "timeline.png")
    assert width >= 1000 and height >= 300
    assert (job / "timeline.png").stat().st_size > 20_000, "a chart, not an empty canvas"
    assert "timeline of steps" in r.stderr


@pytest.mark.timeout(300)
def test_tensorboard_events_read_back(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    for mode, job in jobs(sweep).items():
        ea = EventAccumulator(str(job / "tb"))
        ea.Reload()
        tags = set(ea.Tags()["scalars"])
        expected = {"train/loss", "train/lr", "train/staleness", "time/iter_ms", "time/exposed_comm_ms",
                    "time/comm_ms", "time/hidden_comm_ms", "comm/bytes_per_step", "comm/compression_ratio",
                    "time/predicted_iter_ms", "time/measured_iter_ms", "test/accuracy",
                    "by_time/train/loss", "by_time/test/accuracy", "hparams/test_accuracy", "hparams/iter_ms"}
        assert expected <= tags, expected - tags
        staleness = [e.value for e in ea.Scalars("train/staleness")]
        assert set(staleness) == ({0} if mode == "sync" else {1}), staleness
        assert all(e.value >= 0 for e in ea.Scalars("time/hidden_comm_ms"))
        assert all(e.value == pytest.approx(1.0) for e in ea.Scalars("comm/compression_ratio"))
        assert len(ea.Scalars("train/loss")) == STEPS
        by_time = ea.Scalars("by_time/train/loss")
        assert [e.value for e in by_time] == [e.value for e in ea.Scalars("train/loss")]
        assert all(a.step <= b.step for a, b in zip(by_time, by_time[1:])), "by_time steps are elapsed ms"
        assert ea.Scalars("time/predicted_iter_ms")[-1].step == STEPS
        summary = json.loads((job / "summary.json").read_text())
        assert ea.Scalars("test/accuracy")[-1].value == pytest.approx(summary["test_accuracy"])
        assert ea.Scalars("time/measured_iter_ms")[-1].value == pytest.approx(summary["measured_iter_ms"])

        content = ea.PluginTagToContent("hparams")
        start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        hp = start.session_start_info.hparams
        assert hp["mode"].string_value == mode and hp["compressor"].string_value == "none"
        assert hp["width"].number_value == (1 if mode == "sync" else 2)
        experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        assert "hparams/test_accuracy" in {m.name.tag for m in experiment.metric_infos}


@pytest.mark.timeout(300)
def test_sweep_report_from_a_real_multirun(sweep):
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert [(row["mode"], row["width"], row["compressor"], row["p"]) for row in rows] == [
        ("sync", "1", "none", "2"), ("pipe", "2", "none", "2")]
    sync, pipe = (json.loads((jobs(sweep)[m] / "summary.json").read_text()) for m in ("sync", "pipe"))
    assert float(rows[0]["speedup_vs_sync"]) == pytest.approx(1.0)
    assert float(rows[1]["speedup_vs_sync"]) == pytest.approx(sync["median_iter_ms"] / pipe["median_iter_ms"])
    assert float(rows[1]["test_accuracy"]) == pytest.approx(pipe["test_accuracy"])
    assert float(rows[1]["iter_ms"]) == pytest.approx(pipe["median_iter_ms"])
    md = (sweep / "sweep.md").read_text()
    assert md.count("\n| ") == 4 and "| 1 | pipe | 2 | none | ring | 2 |" in md
    for name in ("sweep_accuracy.png", "sweep_breakdown.png"):
        width, height = png_size(sweep / name)
        assert width > 500 and height > 200


@pytest.mark.timeout(120)
def test_sweep_report_names_a_dir_without_summaries(tmp_path):
    (tmp_path / "0").mkdir()
    with pytest.raises(ReportError, match=f"no summary.json under {tmp_path}"):
        sweep_report(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.report", "sweep", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(tmp_path) in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.report", "timeline", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "trainer.trace=true" in r.stderr and "Traceback" not in r.stderr


