"""A Hydra multirun through the real controller (hydra/launcher=slurm): four jobs, each running its
two workers on a SLURM node, read by `pipesgd_lab.report sweep` as a local multirun is."""

from __future__ import annotations

import json
import sys

import pytest

from slurm_jobs import job_fields, run_on_login, squeue_empty, wait_until
from runs import CACHE, needs_mnist

SWEEP = ["-m", "hydra/launcher=slurm", "+experiment=mnist_mlp", "trainer.mode=sync,pipe", "compressor=none,int8"]
# One CPU per job, so the two nodes (2 CPUs each) run all four jobs at once; 1 GB, 10 minutes.
SMALL = ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10",
         "trainer.max_steps=20", "dist.threads_per_worker=1", "data.eval_batch_size=2000"]


@needs_mnist
@pytest.mark.timeout(280)
def test_sweep_runs_as_slurm_jobs_and_reports(slurm, shared_data, tmp_path):
    sweep = tmp_path / "sweep"
    r = run_on_login(slurm, [sys.executable, "-m", "pipesgd.train", *SWEEP, *SMALL, f"data.root={shared_data}",
                             f"data.cache_dir={CACHE}", f"hydra.sweep.dir={sweep}"],
                     timeout=260, GLOO_SOCKET_IFNAME="lo")
    assert r.returncode == 0, r.stderr[-4000:]

    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(4)]
    assert [(s["mode"], s["compressor"]) for s in summaries] == [
        ("sync", "none"), ("sync", "int8"), ("pipe", "none"), ("pipe", "int8")]
    assert all(s["world_size"] == 2 and s["steps"] == 20 for s in summaries)

    # Each job went through the controller: an array job of four tasks, all COMPLETED on our nodes.
    (array,) = [p.name for p in (sweep / ".submitit").iterdir() if "_" not in p.name]
    # submitit returns once each task has pickled its result, which is before the task's process
    # exits and the controller marks it COMPLETED (the fresh-clone CI of 7385a25 saw one RUNNING):
    # wait, bounded, for each task to leave the queue.
    for task in range(4):
        wait_until(lambda: squeue_empty(slurm, f"{array}_{task}"), 60, f"task {task} of array {array} to leave the queue")
        fields = job_fields(slurm, f"{array}_{task}")
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
        assert fields["NodeList"] in slurm.node_names, fields
        log = (sweep / ".submitit" / f"{array}_{task}" / f"{array}_{task}_0_log.out").read_text()
        assert f"hostname={fields['NodeList']}" in log, log[-2000:]

    report = run_on_login(slurm, [sys.executable, "-m", "pipesgd_lab.report", "sweep", str(sweep)], timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    table = (sweep / "sweep.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 and all(f"| {m} |" in table for m in ("sync", "pipe")), table
