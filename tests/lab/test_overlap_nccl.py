"""The overlap benchmark on NCCL (pipesgd_lab/bench/overlap.py): compute of a step runs while the
previous step's reduction moves. Skipped without CUDA and 2 GPUs; ``PIPESGD_GPU_SUITE_ON_CPU=1``
runs it on Gloo, where only its output is checked (two CPU cores cannot show overlap reliably)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from runs import ROOT

ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= 2
if not ON_GPU and os.environ.get("PIPESGD_GPU_SUITE_ON_CPU") != "1":
    pytestmark = pytest.mark.skip(reason="needs CUDA and >= 2 GPUs (or PIPESGD_GPU_SUITE_ON_CPU=1)")


@pytest.mark.timeout(600)
def test_a_reduction_in_flight_overlaps_the_next_steps_compute(tmp_path):
    out = tmp_path / "overlap.json"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "pipesgd_lab.bench.overlap", "--rounds", "20" if ON_GPU else "2", "--warmup", "1",
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["world"] == 2 and len(result["per_rank_median_ms"]) == 2
    assert all(v > 0 for v in result["median_ms"].values())
    if ON_GPU:
        assert result["config"]["device"] == "cuda"
        assert result["overlap"] > 0.5, f"the reduction ran mostly after the compute: {result['median_ms']}"
