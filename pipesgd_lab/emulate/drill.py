"""``python -m pipesgd_lab.emulate.drill [options] -- <train overrides>``: lose a node and bring it back.

Each emulated node (a network namespace of :class:`~pipesgd_lab.emulate.Cluster`) runs a torchrun
elastic agent with one worker, ``--nnodes MIN:N``, c10d rendezvous hosted by node 0's agent, all
training into one run directory with ``trainer.elastic=true``. Once the run has written a
checkpoint at or after ``--kill-at-step``, every process of node ``--kill-node`` gets SIGKILL; the
survivors' workers fail, their agents re-form the group without it and the workers resume from the
newest checkpoint at the smaller world size. After ``--rejoin-after`` more steps the node's agent
starts again and joins at the next rendezvous. Timings go to ``<run dir>/drill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pipesgd_lab.emulate.cluster import Cluster
from pipesgd_lab.emulate.netns import namespace_pids
from pipesgd.observability.runinfo import write_json_atomic

log = logging.getLogger("pipesgd_lab.emulate.drill")

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
STEP = re.compile(r" step (\d+)/(\d+) ")
RDZV_PORT = 29400


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.emulate.drill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for pipesgd.train (after --)")
    p.add_argument("--nodes", type=int, default=3, help="emulated nodes, one worker each (default 3)")
    p.add_argument("--min-nodes", type=int, default=2, help="torchrun --nnodes MIN (default 2)")
    p.add_argument("--rate", default="1gbit", help="link rate of every node (default 1gbit)")
    p.add_argument("--kill-node", type=int, default=2, help="the node to lose (not 0: it hosts the rendezvous)")
    p.add_argument("--kill-at-step", type=int, default=20, help="kill once a checkpoint at >= this step exists")
    p.add_argument("--rejoin-after", type=int, default=20,
                   help="steps trained at the smaller world before the node comes back (negative: never)")
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory (shared by every node)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="the whole drill (default 900)")
    return p


def stamp(line: str) -> float | None:
    """The unix time of a pipesgd log line (``[2026-11-27 11:47:40,548][...]``), or None."""
    m = STAMP.match(line)
    return None if m is None else datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Log:
    """Rank 0's train.log, read as it grows (every world's rank 0 appends to the same file)."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []

    def poll(self) -> list[str]:
        if self.path.exists():
            self.lines = self.path.read_text(errors="replace").splitlines()
        return self.lines

    def last_step(self) -> int:
        steps = [int(m[1]) for line in self.poll() if (m := STEP.search(line))]
        return steps[-1] if steps else 0


def agent_command(a: argparse.Namespace, host: str, node: int, addr: str) -> list[str]:
    # is_host: node 0 serves the rendezvous store; its namespace address is not the hostname's
    conf = f"join_timeout=300,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3,is_host={node == 0}"
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{a.min_nodes}:{a.nodes}",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{RDZV_PORT}",
            "--rdzv-id", "pipesgd-drill", "--max-restarts", "10", "--monitor-interval", "0.5",
            "--rdzv-conf", conf, "--local-addr", addr,  # not the hostname: it resolves outside the namespace
            "-m", "pipesgd.train", *a.overrides, "trainer.elastic=true", "trainer.log_every=1",
            f"hydra.run.dir={a.run_dir}"]


def start_agent(cluster: Cluster, a: argparse.Namespace, node: int, out: Path) -> subprocess.Popen:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the agents' shared store (torch >= 2.4's default), a
    # node joining a later round waits for MASTER_ADDR under that round's prefix, which rank 0's
    # agent wrote only in the first round: the scale-up times out (seen with torch 2.13).
    env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.interfaces[node], OMP_NUM_THREADS="1",
               PIPESGD_EMULATED_LINK=cluster.rates[node], TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log.info("node %d: starting its agent", node)
    return subprocess.Popen(["ip", "netns", "exec", cluster.namespaces[node], *agent_command(a, cluster.addresses[0], node, cluster.addresses[node])],
                            env=env, stdin=subprocess.DEVNULL, stdout=out.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_node(cluster: Cluster, node: int) -> None:
    for pid in namespace_pids(cluster.namespaces[node]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for(what: str, cond, deadline: float, agents: dict[int, subprocess.Popen]) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"drill: timed out waiting for {what}")
        if all(p.poll() is not None for p in agents.values()):
            raise RuntimeError(f"drill: every agent exited while waiting for {what}")
        time.sleep(0.2)


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt")]
    return max(steps, default=0)


def drill(a: argparse.Namespace) -> dict:
    a.run_dir.mkdir(parents=True, exist_ok=True)
    train_log = Log(a.run_dir / "train.log")
    deadline = time.monotonic() + a.timeout_s
    result: dict = {"nodes": a.nodes, "min_nodes": a.min_nodes, "rate": a.rate, "kill_node": a.kill_node}
    with Cluster(a.nodes, a.rate) as cluster:
        agents = {i: start_agent(cluster, a, i, a.run_dir / f"node{i}.log") for i in range(a.nodes)}
        try:
            _wait_for(f"a checkpoint at step >= {a.kill_at_step}",
                      lambda: newest_checkpoint(a.run_dir) >= a.kill_at_step, deadline, agents)
            result["killed_at_step"] = train_log.last_step()
            result["newest_checkpoint_step"] = newest_checkpoint(a.run_dir)
            t_kill = time.time()
            kill_node(cluster, a.kill_node)
            agents.pop(a.kill_node).wait()
            log.info("node %d killed at step %d (newest checkpoint %d)", a.kill_node, result["killed_at_step"],
                     result["newest_checkpoint_step"])
            shrink = f"elastic resume: world {a.nodes} -> {a.nodes - 1} ranks"
            _wait_for("the smaller world's resume", lambda: any(shrink in x for x in train_log.poll()), deadline, agents)
            i = next(k for k, x in enumerate(train_log.poll()) if shrink in x)
            _wait_for("the first step at the smaller world",
                      lambda: any(STEP.search(x) for x in train_log.poll()[i:]), deadline, agents)
            lines = train_log.lines
            first = next(x for x in lines[i:] if STEP.search(x))
            resumed = re.search(r"step (\d+) -> (\d+)", lines[i])
            result |= {"seconds_to_resume": stamp(lines[i]) - t_kill, "seconds_to_first_step": stamp(first) - t_kill,
                       "steps_lost": result["killed_at_step"] - int(resumed[1]) if resumed else None,
                       "shrink_line": lines[i].split(" - ", 1)[-1]}
            log.info("the group re-formed with %d nodes: first step %.1f s after the kill, %s steps of work lost",
                     a.nodes - 1, result["seconds_to_first_step"], result["steps_lost"])
            if a.rejoin_after >= 0:
                at = int(STEP.search(first)[1]) + a.rejoin_after
                _wait_for(f"step {at}", lambda: train_log.last_step() >= at, deadline, agents)
                t_back = time.time()
                agents[a.kill_node] = start_agent(cluster, a, a.kill_node, a.run_dir / f"node{a.kill_node}.log")
                grow = f"elastic resume: world {a.nodes - 1} -> {a.nodes} ranks"
                _wait_for("the node's rejoin", lambda: any(grow in x for x in train_log.poll()), deadline, agents)
                line = next(x for x in train_log.poll() if grow in x)
                result |= {"seconds_to_rejoin": stamp(line) - t_back, "grow_line": line.split(" - ", 1)[-1]}
            for node, p in agents.items():
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            result["agent_exit_codes"] = {node: p.returncode for node, p in agents.items()}
        finally:
            for node in list(agents):
                kill_node(cluster, node)
    summary = a.run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        result |= {"test_accuracy": s["test_accuracy"], "world_size": s["world_size"], "steps": s["steps"]}
    write_json_atomic(a.run_dir / "drill.json", result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not 0 < a.kill_node < a.nodes:
        parser.error(f"--kill-node {a.kill_node} must be in 1..{a.nodes - 1} (node 0 hosts the rendezvous)")
    if not 1 <= a.min_nodes < a.nodes:
        parser.error(f"--min-nodes {a.min_nodes} must be in 1..{a.nodes - 1}, so the job survives a lost node")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    a.run_dir = a.run_dir.resolve()
    try:
        result = drill(a)
    except (TimeoutError, RuntimeError) as e:
        log.error("%s (node logs: %s/node*.log)", e, a.run_dir)
        return 1
    print(json.dumps(result, indent=2))
    codes = result.get("agent_exit_codes", {})
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
