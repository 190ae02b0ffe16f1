"""docs/multi-node.md's "Live recovery under torchrun" on two emulated nodes (network namespaces,
root only): the lighthouse started once on node 0's address (python -m pipesgd.live.lighthouse),
then on each node a torchrun job of one process, trainer.mode=live, told the lighthouse, the run's
id and its own replica group by its command. Group 1's worker SIGKILLs itself mid-run
(PIPESGD_FAULT, its first process only); torchrun restarts it, it heals from group 0, and both
groups end with the same weights. Skipped without root, torchft or MNIST, except that under
CI=true a missing torchft fails (tests/e2e/test_live_mode.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from runs import CACHE, ROOT, kill_sessions, needs_mnist, summary, tagged_processes
from conftest import SHARED_DATA
from needs_torchft import require_torchft

require_torchft()

STEPS, KILL_AT = 30, 8


def group_command(namespace: str, address: str, lighthouse: str, run_id: str, replica: int, run_dir) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.5",
            "-m", "pipesgd.train", "+experiment=mnist_mlp", "trainer.mode=live",
            f"trainer.live.lighthouse={lighthouse}", f"trainer.live.run_id={run_id}", f"trainer.live.replica={replica}",
            "trainer.live.replicas=2", f"trainer.live.host={address}",
            # both groups in every quorum: the survivor waits for the restarted group instead of
            # finishing alone (a restart takes torchrun's detection plus the imports)
            "trainer.live.min_replicas=2", "trainer.live.quorum_timeout_s=240",
            f"trainer.max_steps={STEPS}", "data.batch_size=250", "optimizer.lr=0.01",
            "trainer.lr_reference_batch=250", "dist.threads_per_worker=1", "trainer.eval_max_batches=4",
            "trainer.log_every=5", f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}", f"hydra.run.dir={run_dir}"]


@needs_mnist
@pytest.mark.timeout(420)
def test_torchrun_replica_groups_on_two_nodes_heal_a_restarted_one_and_agree(netns, tmp_path):
    from pipesgd_lab.emulate import Cluster

    run_dir, run_id, tag = tmp_path / "run", f"e2e-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "PIPESGD_FAULT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), OMP_NUM_THREADS="1",
               PIPESGD_TEST_TAG=tag)
    procs: list[subprocess.Popen] = []
    with Cluster(2, "1gbit", handle_signals=False) as cluster:
        try:
            lighthouse = subprocess.Popen(
                ["ip", "netns", "exec", cluster.namespaces[0], sys.executable, "-m", "pipesgd.live.lighthouse",
                 "--host", cluster.addresses[0], "--min-replicas", "2"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=(tmp_path / "lighthouse.log").open("w"), text=True,
                start_new_session=True)
            procs.append(lighthouse)
            address = lighthouse.stdout.readline().strip()
            assert address.startswith(f"http://{cluster.addresses[0]}:"), (tmp_path / "lighthouse.log").read_text()
            for node in (0, 1):
                node_env = dict(env, GLOO_SOCKET_IFNAME=cluster.interfaces[node])
                if node == 1:
                    node_env["PIPESGD_FAULT"] = f"kill:1:{KILL_AT}"  # group 1's first process only
                procs.append(subprocess.Popen(
                    group_command(cluster.namespaces[node], cluster.addresses[node], address, run_id, node, run_dir),
                    cwd=ROOT, env=node_env, stdout=subprocess.DEVNULL,
                    stderr=(tmp_path / f"node{node}.log").open("w"), start_new_session=True))
            codes = [p.wait(timeout=360) for p in procs[1:]]
        finally:
            kill_sessions(procs)
    logs = {node: (tmp_path / f"node{node}.log").read_text(errors="replace") for node in (0, 1)}
    assert codes == [0, 0], f"{codes}\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    assert first["mode"] == second["mode"] == "live" and first["steps"] == second["steps"] == STEPS
    assert first["param_checksum"] == second["param_checksum"]
    assert first["global_batch"] == 500  # two shards of 250: each group read its own
    group_logs = {r: (run_dir / f"replica_{r}" / "train.log").read_text() for r in (0, 1)}
    # torchrun restarted group 1's worker (its restart count is the group's), never group 0's
    assert "replica group 1 restart 1 pid" in group_logs[1] and "replica group 0 restart 1" not in group_logs[0]
    assert "healed from a peer" in group_logs[1].split("replica group 1 restart 1 pid", 1)[1]
    assert summary(run_dir) == first  # group 0's, copied into the run directory as the local launcher does
    assert not tagged_processes(tag)


@needs_mnist
@pytest.mark.timeout(480)
def test_the_live_drill_under_torchrun_measures_a_killed_group_that_heals(netns, tmp_path):
    """``python -m pipesgd_lab.bench.live_drill --launcher torchrun``: two emulated nodes, group 1
    killed after step KILL_AT, restarted by its torchrun; the drill's JSON has the survivor's stall,
    the returning group's way back (its new process's start, from the kernel, split at its imports)
    and every group's same final weights; no namespace or process of it is left."""
    from pipesgd_lab.emulate.netns import list_namespaces

    tag, out = uuid.uuid4().hex, tmp_path / "drill.json"
    env = {k: v for k, v in os.environ.items() if k != "PIPESGD_FAULT"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), PIPESGD_TEST_TAG=tag)
    overrides = ["trainer.live.min_replicas=2", "trainer.live.quorum_timeout_s=240", f"trainer.max_steps={STEPS}",
                 "data.batch_size=250", "optimizer.lr=0.01", "trainer.lr_reference_batch=250",
                 "trainer.eval_max_batches=4", f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}"]
    drill = subprocess.Popen(
        [sys.executable, "-m", "pipesgd_lab.bench.live_drill", "--launcher", "torchrun", "--replicas", "2",
         "--fault", "kill", "--at-step", str(KILL_AT), "--no-reference", "--timeout-s", "400",
         "--dir", str(tmp_path / "runs"), "--json", str(out), *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = drill.communicate(timeout=450)
    finally:
        if drill.poll() is None:
            os.killpg(drill.pid, signal.SIGTERM)  # the drill tears its cluster down on SIGTERM
            drill.wait(timeout=30)
    assert drill.returncode == 0, output[-4000:]
    assert not [ns for ns in list_namespaces() if ns.startswith(f"psgd{drill.pid}")]
    assert not tagged_processes(tag)
    res = json.loads(out.read_text())
    assert (res["launcher"], res["rate"], res["replicas"]) == ("torchrun", "1gbit", 2)
    d = res["runs"][0]["drill"]
    assert (d["fault"], d["faulted_group"], d["fault_step"]) == ("kill", 1, KILL_AT)
    assert d["steps"] == {"0": STEPS, "1": STEPS}
    # the survivor waited for the restarted group (min_replicas=2): a gap well over its median step
    assert d["survivors_stall_s"] is not None and d["survivors_stall_s"] > 0
    assert d["survivors"]["0"]["longest_gap_s"] > d["survivors"]["0"]["normal_step_s"]
    back = d["returning"]
    assert (back["restart"], back["healed"]) == (1, True) and back["first_step"] > KILL_AT
    assert back["started_at"] > d["fault_at"] - 1 and back["import_s"] > 0 and back["setup_s"] >= 0
    assert back["to_train_s"] == pytest.approx(back["import_s"] + back["setup_s"] + back["join_s"], abs=1e-6)
    assert d["healed"]["1"] >= 1
    assert d["first_joint_step"] is not None and d["first_joint_step"]["identical"] is True
    assert d["weights_agree"] is True and len(set(d["param_checksums"].values())) == 1


@needs_mnist
@pytest.mark.timeout(300)
def test_the_live_drill_under_torchrun_tears_its_cluster_down_when_stopped(netns, tmp_path):
    """SIGTERM to the drill while its groups train: it exits non-zero, and neither its namespaces
    nor any process it started is left."""
    from pipesgd_lab.emulate.netns import list_namespaces

    tag, runs = uuid.uuid4().hex, tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k != "PIPESGD_FAULT"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), PIPESGD_TEST_TAG=tag)
    drill = subprocess.Popen(
        [sys.executable, "-m", "pipesgd_lab.bench.live_drill", "--launcher", "torchrun", "--replicas", "2",
         "--at-step", "100000", "--no-reference", "--timeout-s", "250", "--dir", str(runs),
         "trainer.live.min_replicas=2", f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        stepped = False
        while not stepped and drill.poll() is None and time.monotonic() < deadline:
            stepped = any(" step " in p.read_text(errors="replace") for p in runs.glob("*/replica_1/train.log"))
            time.sleep(0.2)  # polling the log, not synchronising: the drill runs on its own
        assert stepped and drill.poll() is None, "group 1 never trained"
        assert [ns for ns in list_namespaces() if ns.startswith(f"psgd{drill.pid}")]  # the cluster is up
        drill.send_signal(signal.SIGTERM)
        code = drill.wait(timeout=60)
    finally:
        if drill.poll() is None:
            os.killpg(drill.pid, signal.SIGKILL)
            drill.wait()
    assert code == 1
    assert not [ns for ns in list_namespaces() if ns.startswith(f"psgd{drill.pid}")]
    assert not tagged_processes(tag)
