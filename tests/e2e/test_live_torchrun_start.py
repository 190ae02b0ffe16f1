"""Replica groups started on their own, a torchrun job each (docs/multi-node.md, "Live recovery
under torchrun"), on loopback, wait for each other before their first step when told
(trainer.live.start_replicas): the lighthouse started once (python -m pipesgd.live.lighthouse,
min_replicas 1), group 0's job started alone and seen waiting, group 1's job started only then.
Neither heals (without the barrier group 0 trains alone and group 1 heals at its step, the
drill's failure in docs/reliability.md), both train every step together and end on the same
weights. Skipped without torchft or MNIST, except that under CI=true a missing torchft fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from runs import CACHE, ROOT, kill_sessions, needs_mnist, summary, tagged_processes
from conftest import SHARED_DATA
from needs_torchft import require_torchft

require_torchft()

STEPS = 10


def _group(address: str, run_id: str, replica: int, run_dir, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
         "-m", "pipesgd.train", "+experiment=mnist_mlp", "trainer.mode=live", f"trainer.live.lighthouse={address}",
         f"trainer.live.run_id={run_id}", f"trainer.live.replica={replica}", "trainer.live.replicas=2",
         "trainer.live.host=127.0.0.1", "trainer.live.start_replicas=2", "trainer.live.start_timeout_s=200",
         f"trainer.max_steps={STEPS}", "data.batch_size=250", "optimizer.lr=0.01", "trainer.lr_reference_batch=250",
         "dist.threads_per_worker=1", "trainer.eval_max_batches=4", "trainer.log_every=5", f"data.root={SHARED_DATA}",
         f"data.cache_dir={CACHE}", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


@needs_mnist
@pytest.mark.timeout(300)
def test_torchrun_groups_told_to_wait_start_together_and_neither_heals(tmp_path):
    run_dir, run_id, tag = tmp_path / "run", f"start-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "PIPESGD_FAULT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", PIPESGD_TEST_TAG=tag)
    procs: list[subprocess.Popen] = []
    logs = [(tmp_path / f"group{r}.log").open("w") for r in (0, 1)]
    try:
        lighthouse = subprocess.Popen([sys.executable, "-m", "pipesgd.live.lighthouse", "--host", "127.0.0.1"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=(tmp_path / "lighthouse.log").open("w"), text=True,
                                      start_new_session=True)
        procs.append(lighthouse)
        address = lighthouse.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), (tmp_path / "lighthouse.log").read_text()
        first = _group(address, run_id, 0, run_dir, env, logs[0])
        procs.append(first)
        group_log = run_dir / "replica_0" / "train.log"
        deadline = time.monotonic() + 200
        waiting = False
        while not waiting:  # polling group 0's log, not synchronising: its job runs on its own
            assert first.poll() is None, (tmp_path / "group0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "group 0 never reached its start barrier"
            waiting = group_log.exists() and "waiting for 2 replica groups of run" in group_log.read_text()
            time.sleep(0.2)
        procs.append(_group(address, run_id, 1, run_dir, env, logs[1]))
        codes = [p.wait(timeout=240) for p in procs[1:]]
    finally:
        kill_sessions(procs)
        for f in logs:
            f.close()
    outputs = [(tmp_path / f"group{r}.log").read_text(errors="replace")[-3000:] for r in (0, 1)]
    assert codes == [0, 0], "\n".join(outputs)
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    assert first["steps"] == second["steps"] == STEPS
    assert first["live_healed"] == second["live_healed"] == 0, "a group healed: they did not start together"
    assert first["param_checksum"] == second["param_checksum"]
    for r in (0, 1):
        text = (run_dir / f"replica_{r}" / "train.log").read_text()
        assert f"start barrier: 2 replica groups of run {run_id} heard by the lighthouse after" in text
        assert "healed from a peer" not in text
    assert not tagged_processes(tag)
