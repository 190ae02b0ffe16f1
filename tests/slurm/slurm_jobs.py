"""Helpers for the SLURM tier (tests/slurm): submit as a user on the login host, read a job's state,
wait for what a job does. The cluster itself is the `slurm` fixture of tests/conftest.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipesgd_lab.emulate.slurm import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]


def job_env(**extra: str) -> dict[str, str]:
    """The environment a test submits with: this venv first on PATH (torchrun, python), Gloo free to
    pick the node's own interface (the tests' default GLOO_SOCKET_IFNAME=lo would keep two nodes
    apart), no torchrun variables of an outer launcher."""
    drop = ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "PIPESGD_FAULT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env | extra


def squeue_empty(slurm: SlurmCluster, job: str) -> bool:
    done = slurm.run(["squeue", "--noheader", "--jobs", job], timeout=30)
    return done.returncode == 0 and not done.stdout.strip()


def job_fields(slurm: SlurmCluster, job: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...); finished jobs stay 10 min."""
    out = slurm.run(["scontrol", "show", "job", "--oneliner", job], timeout=30).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll a condition set by a process we do not control (a SLURM job); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.5)


def run_on_login(slurm: SlurmCluster, args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return slurm.run(args, env=job_env(**env), cwd=ROOT, timeout=timeout)


def tracebacks(log: str) -> list[str]:
    """The log's Python tracebacks, less the one torchrun's exit barrier may log on a clean exit.

    An agent that reaches the barrier after the store's host agent has already passed it and exited
    finds the store gone (pytorch/pytorch#69520); torch logs "Error waiting on exit barrier" with
    the traceback, and the agent still exits 0. Lines of that logger call carry its pid and call site.
    """
    barrier = re.compile(r"(\d+ torch/distributed/elastic/agent/server/api\.py:\d+\]) Error waiting on exit barrier")
    benign = {m[1] for m in barrier.finditer(log)}
    return [line for line in log.splitlines()
            if "Traceback" in line and not any(site in line for site in benign)]
