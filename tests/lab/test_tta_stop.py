"""A bench or curve driver stopped from outside (SIGTERM, as a session's end or `kill` sends) stops its
training child and says so in the run's segment record, instead of leaving ``end: null``."""

import json
import signal
import subprocess
import sys

import pytest

from pipesgd_lab.bench import tta
from pipesgd_lab.bench import tta_records as records

# The child stops its parent (this test process) once it runs, then would sleep far past the timeout.
CHILD = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(120)"


@pytest.mark.timeout(60)
def test_sigterm_stops_the_child_and_records_the_segment(tmp_path):
    run_dir = tmp_path / "runs" / "sync-s0"
    # Whatever an earlier test in this process left installed (torch's elastic launcher sets its own).
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tta.Stopped) as e, tta.stop_on_signals():
        tta._run_segment([sys.executable, "-c", CHILD], run_dir, timeout_s=50)
    assert e.value.sig == signal.SIGTERM
    (row,) = json.loads(records.segments_path(run_dir).read_text())
    assert row["ok"] is False and row["stopped"] == "SIGTERM" and row["end"] is not None
    assert signal.getsignal(signal.SIGTERM) is before, "the previous handler is restored"
    log = (run_dir.parent / "sync-s0.log").read_text()
    assert log.startswith("$ "), log


@pytest.mark.timeout(60)
def test_a_finished_segment_is_recorded_ok(tmp_path):
    run_dir = tmp_path / "runs" / "sync-s0"
    assert tta._run_segment([sys.executable, "-c", "print('hi')"], run_dir, timeout_s=50)
    assert not tta._run_segment([sys.executable, "-c", "raise SystemExit(3)"], run_dir, timeout_s=50)
    rows = json.loads(records.segments_path(run_dir).read_text())
    assert [(r["ok"], "stopped" in r) for r in rows] == [(True, False), (False, False)]
    assert (run_dir.parent / "sync-s0.log").read_text().count("$ ") == 2, "appended, not overwritten"


@pytest.mark.timeout(120)
def test_the_driver_exits_143_when_stopped(tmp_path):
    """End to end through main(): the curves phase's child is the one that sends the SIGTERM."""
    wrapper = tmp_path / "stopper.py"
    wrapper.write_text(CHILD)
    driver = ("import sys; from pipesgd_lab.bench import tta; "
              f"tta.train_command = lambda *a, **k: [sys.executable, {str(wrapper)!r}]; "
              "sys.exit(tta.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", driver, "--phase", "curves", "--arms", "sync", "--seeds", "0",
                        "--dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=100)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-2000:]
    assert "stopped by SIGTERM" in r.stderr
    (row,) = json.loads((tmp_path / "d" / "runs" / "sync-s0.segments.json").read_text())
    assert row["stopped"] == "SIGTERM" and row["ok"] is False


@pytest.mark.timeout(120)
def test_the_bench_driver_stops_its_child_and_exits_143(tmp_path):
    """``python -m pipesgd_lab.bench`` shares the mechanism: its cell's child (here the stopper) is
    stopped, not left running in its own session, and the driver exits 128 + SIGTERM."""
    stopper, marker = tmp_path / "stopper.py", tmp_path / "child-survived"
    stopper.write_text(CHILD.replace("time.sleep(120)", f"time.sleep(20); open({str(marker)!r}, 'w')"))
    driver = ("import sys\nfrom pathlib import Path\nfrom pipesgd_lab.bench import __main__ as bench, runner\n"
              "def run_cells(cells, settings):\n"
              f"    runner.run_logged([sys.executable, {str(stopper)!r}], Path({str(tmp_path / 'cell.log')!r}), 60)\n"
              "    yield from ()\n"
              "bench.run_cells = run_cells\n"
              "sys.exit(bench.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", driver, "--only", "resnet20/p2/loopback/local", "--out",
                        str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md"), "--dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-2000:]
    assert "stopped by SIGTERM" in r.stderr
    assert subprocess.run(["pgrep", "-f", str(stopper)], capture_output=True).returncode == 1, "child still running"
    assert not marker.exists()
