"""docs/multi-node.md's two-host command, run as two "hosts" on one machine: two torchrun agents
(static rendezvous on loopback), each in its own working directory. One run directory with one
summary.json for the whole world must come out, and host B must write nothing. With two workers a
host and ``dist.ranks_per_replica`` unset, each host is one DiLoCo replica of two ranks."""

import json
import os
import subprocess
import sys

import pytest
from distributed_utils import free_port
from runs import CACHE, ROOT


def _two_hosts(tmp_path, shared_data, nproc: int, *overrides: str) -> tuple[dict, list[str]]:
    """Host A (node rank 0) and host B, ``nproc`` workers each: rank 0's summary.json and each
    host's stderr."""
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
             "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "pipesgd.train", "+experiment=mnist_mlp", f"data.root={shared_data}",
             f"data.cache_dir={CACHE}", "trainer.max_steps=6", "trainer.log_every=3",
             "dist.threads_per_worker=1", f"hydra.run.dir={run_dir}", *overrides],
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
    assert (run_dir / "tb").is_dir() and (run_dir / ".hydra" / "config.yaml").exists()
    assert not any(hosts[1].iterdir()), f"host B wrote {list(hosts[1].iterdir())}"
    return json.loads((run_dir / "summary.json").read_text()), [err for _, err in outputs]


@pytest.mark.timeout(300)
def test_two_torchrun_agents_form_one_job(tmp_path, shared_data):
    summary, errs = _two_hosts(tmp_path, shared_data, 1)
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert "step 6/6" in errs[0] and "step 6/6" not in errs[1], "only rank 0 reports progress"


@pytest.mark.timeout(300)
def test_two_nodes_of_two_workers_are_two_replicas_of_two_ranks(tmp_path, shared_data):
    """torchrun numbers node n's workers n·2, n·2+1: with dist.ranks_per_replica unset a node is a
    replica; the inner steps average inside it, the rounds go between the two nodes in two shards."""
    summary, errs = _two_hosts(tmp_path, shared_data, 2, "trainer.sync_every=3",
                               "trainer.check_every=1", "data.batch_size=32")
    assert (summary["world_size"], summary["replicas"], summary["ranks_per_replica"]) == (4, 2, 2)
    assert summary["steps"] == 6 and summary["rounds"] == 2 and summary["bytes_inside_replica"] > 0
    assert summary["config"]["dist"]["ranks_per_replica"] is None  # unset: the node
    assert "replicas: 2 of 2 ranks each" in errs[0]
