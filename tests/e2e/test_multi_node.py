"""docs/multi-node.md's two-host command, run as two "hosts" on one machine: two torchrun agents
(static rendezvous on loopback), one worker each, each in its own working directory. One run
directory with one summary.json for a world of 2 must come out, and host B must write nothing."""

import json
import os
import subprocess
import sys

import pytest
from distributed_utils import free_port
from runs import CACHE, ROOT


@pytest.mark.timeout(300)
def test_two_torchrun_agents_form_one_job(tmp_path, shared_data):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    hosts = [tmp_path / "hostA", tmp_path / "hostB"]
    procs = []
    for node_rank, cwd in enumerate(hosts):
        cwd.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "pipesgd.train", "+experiment=mnist_mlp", f"data.root={shared_data}",
             f"data.cache_dir={CACHE}", "trainer.max_steps=6", "trainer.log_every=3",
             "dist.threads_per_worker=1", f"hydra.run.dir={run_dir}"],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=280) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert (run_dir / "tb").is_dir() and (run_dir / ".hydra" / "config.yaml").exists()
    assert not any(hosts[1].iterdir()), f"host B wrote {list(hosts[1].iterdir())}"
    assert "step 6/6" in outputs[0][1] and "step 6/6" not in outputs[1][1], "only rank 0 reports progress"
