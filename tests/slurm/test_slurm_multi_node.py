"""examples/slurm_multi_node.sbatch on two SLURM nodes (two slurmd, each in its own emulated host:
namespace, hostname, address on the shaped bridge): one torchrun agent per node, the c10d
rendezvous on the allocation's first node. Then the failures a scheduler causes: a job cancelled
with scancel and a job killed at its time limit, both mid-run, resume from their newest
checkpoint when resubmitted with the same run directory, and finish bit-identical to the
uninterrupted job; the job's state and log say what happened."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from slurm_jobs import job_fields, run_on_login, squeue_empty, tracebacks, wait_until
from runs import CACHE, SHARED_DATA, needs_mnist

SCRIPT = "examples/slurm_multi_node.sbatch"
# As tests/e2e/test_reliability.py: 30 steps per epoch, checkpoints at 8, 16, 24, 30, 32 (40 at
# the end); a rank that hangs after step 35 leaves step-32 as the newest checkpoint.
MNIST = ["+experiment=mnist_mlp", "trainer.max_steps=40", "data.batch_size=1000", "optimizer.lr=0.05",
         "trainer.lr_reference_batch=null", "trainer.checkpoint_every=8", "trainer.check_every=4",
         "trainer.log_every=10", "trainer.eval_every_steps=12"]
HANG_STEP, RESUME_STEP = 35, 32
MODEL_BYTES = 4 * (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10)  # the MLP's fp32 gradients


def submit(slurm, tmp_path: Path, run_dir: Path, *sbatch: str, **env: str) -> str:
    """sbatch the recipe (one CPU per node, its log in tmp_path/<job>.out) for `run_dir`; the job id."""
    r = run_on_login(slurm, ["sbatch", "--parsable", "--cpus-per-task=1", f"--output={tmp_path}/%j.out", *sbatch,
                             SCRIPT, *MNIST, f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}"],
                     timeout=60, RUN_DIR=str(run_dir), **env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def finished(slurm, job: str, timeout_s: float) -> dict[str, str]:
    wait_until(lambda: squeue_empty(slurm, job), timeout_s, f"job {job} to leave the queue")
    return job_fields(slurm, job)


def link_bytes(slurm, node: str) -> int:
    """Bytes the node has sent through its shaped link (tbf on its veth) since the cluster started."""
    i = slurm.node_names.index(node) + 1
    out = subprocess.run(["tc", "-s", "-n", slurm.cluster.namespaces[i], "qdisc", "show", "dev", f"veth{i}"],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", out)[1])


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """The uninterrupted two-node job: its run dir, summary, scontrol fields, log and link bytes."""
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"offline datasets not found at {SHARED_DATA}")
    tmp = tmp_path_factory.mktemp("two-nodes")
    sent_before = {n: link_bytes(slurm, n) for n in slurm.node_names}
    job = submit(slurm, tmp, tmp / "run")
    fields = finished(slurm, job, 240)
    log = (tmp / f"{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, log[-4000:])
    sent = {n: link_bytes(slurm, n) - sent_before[n] for n in slurm.node_names}
    return tmp / "run", json.loads((tmp / "run" / "summary.json").read_text()), fields, log, sent


@needs_mnist
@pytest.mark.timeout(280)
def test_one_job_trains_across_two_slurm_nodes(slurm, reference):
    run_dir, s, fields, log, sent = reference
    assert fields["NodeList"] == "node[1-2]" and fields["NumNodes"] == "2", fields
    assert s["world_size"] == 2 and s["steps"] == 40 and s["resumed_from_step"] is None
    assert s["test_accuracy"] > 0.5, "the run must really train, or equality below proves little"
    # The gradients crossed the emulated network: the ring sends each rank about half the
    # gradient bytes per step (40 steps), every byte through the node's own shaped link.
    for node, n in sent.items():
        assert n > 40 * MODEL_BYTES / 2, (node, n)
    assert "Exited with exit code" not in log and not tracebacks(log), log[-3000:]


@needs_mnist
@pytest.mark.timeout(290)
def test_cancelled_and_timed_out_jobs_resume_bit_identical(slurm, reference, tmp_path):
    """Two jobs hang at step 35 (PIPESGD_FAULT=hang:1:35), at once: one is scancelled as soon as it
    hangs, the other runs into its 1-minute time limit. Each is resubmitted with its run dir."""
    cancelled, timed_out = tmp_path / "cancelled", tmp_path / "timed-out"
    fault = {"PIPESGD_FAULT": f"hang:1:{HANG_STEP}"}
    jobs = {"cancelled": submit(slurm, tmp_path, cancelled, **fault),
            "timed-out": submit(slurm, tmp_path, timed_out, "--time=1", **fault)}
    logs = {name: tmp_path / f"{job}.out" for name, job in jobs.items()}

    def hung(name: str) -> bool:
        return logs[name].exists() and f"does 'hang' at step {HANG_STEP}" in logs[name].read_text()

    wait_until(lambda: hung("cancelled"), 200, "the first job to reach the hang")
    assert slurm.run(["scancel", jobs["cancelled"]], timeout=30).returncode == 0
    states = {"cancelled": finished(slurm, jobs["cancelled"], 60)}
    resumed = {"cancelled": submit(slurm, tmp_path, cancelled)}
    states["timed-out"] = finished(slurm, jobs["timed-out"], 200)
    assert hung("timed-out"), "the time limit must strike mid-run, at the hang"
    resumed["timed-out"] = submit(slurm, tmp_path, timed_out)

    assert states["cancelled"]["JobState"] == "CANCELLED", states
    assert states["timed-out"]["JobState"] == "TIMEOUT" and states["timed-out"]["Reason"] == "TimeLimit", states
    checkpoint = f"step-{RESUME_STEP:08d}.pt"
    for name, run_dir in (("cancelled", cancelled), ("timed-out", timed_out)):
        log = logs[name].read_text()
        because = " DUE TO TIME LIMIT ***" if name == "timed-out" else " ***"
        assert re.search(rf"\*\*\* JOB {jobs[name]} ON node\d CANCELLED AT \S+{re.escape(because)}", log), log[-3000:]
        # pipesgd's own line, from a rank blocked in a collective as much as from the hanging one.
        said = re.findall(rf"rank (\d): SIGTERM at step \d+ .*exiting with status 143\. The newest checkpoint is "
                          rf"{re.escape(str(run_dir / 'checkpoints' / checkpoint))}", log)
        assert "0" in said, log[-3000:]
        fields = finished(slurm, resumed[name], 240)
        again = (tmp_path / f"{resumed[name]}.out").read_text()
        assert fields["JobState"] == "COMPLETED", (fields, again[-3000:])
        assert f"resuming from {run_dir / 'checkpoints' / checkpoint}" in again, again[-3000:]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["resumed_from_step"] == RESUME_STEP and s["steps"] == 40
        assert s["param_checksum"] == reference[1]["param_checksum"], f"{name}: final weights must be bit-identical"
        assert s["test_accuracy"] == reference[1]["test_accuracy"]
