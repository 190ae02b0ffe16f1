"""pipesgd_lab.emulate.slurm leaves nothing behind: not when the block raises with a job running, and
not from the command line. Namespaces, daemons, jobs, the state directory, the hosts files."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from pipesgd.launch import has_exited
from pipesgd_lab.emulate.netns import list_namespaces
from runs import ROOT, tagged_processes
from slurm_jobs import job_env, job_fields, wait_until


@pytest.mark.timeout(120)
def test_failing_block_with_a_running_job_tears_everything_down(slurm, tmp_path):
    """`slurm` (the session's cluster) only proves the programs are here; this test builds its own."""
    from pipesgd_lab.emulate.slurm import SlurmCluster

    tag = os.urandom(8).hex()
    with pytest.raises(RuntimeError, match="the test body failed"):  # noqa: PT012
        with SlurmCluster(nodes=2, kill_wait_s=1, log_dir=tmp_path / "logs", handle_signals=False) as own:
            seen = (own.cluster.namespaces, own.daemon_pids, own.state, own.conf)
            r = own.run(["sbatch", "--parsable", "--nodes=2", "--wrap", "srun sleep 600"],
                        env=job_env(PIPESGD_TEST_TAG=tag), cwd=tmp_path, timeout=30)
            assert r.returncode == 0, r.stderr
            job = r.stdout.strip()
            wait_until(lambda: job_fields(own, job).get("JobState") == "RUNNING"
                       and len(tagged_processes(tag)) >= 2, 60, "the job's sleep on both nodes")
            raise RuntimeError("the test body failed")
    namespaces, daemons, state, conf = seen
    assert not set(namespaces) & set(list_namespaces())
    assert not [label for label, pid in daemons.items() if not has_exited(pid)], daemons
    assert not tagged_processes(tag), "the job's processes must be gone"
    assert not state.exists() and not conf.exists()
    assert not [ns for ns in namespaces if (Path("/etc/netns") / ns).exists()]
    assert (tmp_path / "logs" / "slurmctld.log").exists() and (tmp_path / "logs" / "slurm.conf").exists()


@pytest.mark.timeout(120)
def test_command_line_runs_a_command_on_the_login_host(slurm, tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.emulate.slurm", "--nodes", "2", "--", "sh", "-c",
                        "hostname && srun --nodes=2 hostname | sort && exit 3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 3, r.stderr[-3000:]
    assert r.stdout.split() == ["login", "node1", "node2"], r.stdout
    prefix = re.search(r"login host: (psgd\d+(?:x\d+)?)-0;", r.stderr)[1]
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]


@pytest.mark.timeout(120)
def test_after_a_sigkill_emulate_cleanup_stops_every_daemon(slurm, tmp_path):
    """Every daemon lives in a namespace, so `python -m pipesgd_lab.emulate --cleanup` stops them with
    the namespaces and removes the hosts files; only the state directory is left (removed here)."""
    import glob
    import shutil
    import signal
    import subprocess

    from pipesgd_lab.emulate.netns import namespace_pids

    proc = subprocess.Popen([sys.executable, "-m", "pipesgd_lab.emulate.slurm", "--", "sleep", "300"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prefix = "(not started)"
    try:
        for line in proc.stderr:
            if "login host: " in line:
                break
        prefix = re.search(r"login host: (psgd\d+(?:x\d+)?)-0;", line)[1]
        namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]
        pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
        assert len(pids) >= 5, pids  # munged, slurmctld, two slurmd, the sleep (and their wrappers)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        r = subprocess.run([sys.executable, "-m", "pipesgd_lab.emulate", "--cleanup"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert not [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]
        assert not [pid for pid in pids if not has_exited(pid)]
        assert not [ns for ns in namespaces if (Path("/etc/netns") / ns).exists()]
    finally:
        proc.kill()
        proc.wait()
        for state in glob.glob(f"/tmp/{prefix}-slurm-*"):
            shutil.rmtree(state, ignore_errors=True)
