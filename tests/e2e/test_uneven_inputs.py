"""Uneven inputs under torchrun, as a ported DDP script meets them: rank 0 has one batch fewer and goes
on to an evaluation collective. Without ``join()`` the other rank's reduction times out and BOTH
processes end (the communication thread must not keep one alive); with it, the job finishes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import ROOT

SCRIPT = """
import sys, torch, torch.distributed as dist
from torch import nn
from pipesgd import PipeSGD

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
engine = PipeSGD(opt, model.parameters(), width=2, timeout_s=5)
use_join = sys.argv[1] == "join"

def train():
    for i in range(5 if rank == 0 else 6):  # rank 0 has one batch fewer
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        engine.step()

if use_join:
    with engine.join():
        train()
else:
    train()
engine.flush()
total = torch.ones(1)
dist.all_reduce(total)  # the evaluation
print(f"rank {rank} finished: {total.item():g} ranks, {engine.shadowed} shadowed", flush=True)
engine.close()
dist.destroy_process_group()
"""


def _pids_running(path: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and path in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return pids


def _torchrun(tmp_path, mode: str, deadline: float = 60) -> tuple[int | None, str, float]:
    script = tmp_path / "uneven.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), mode], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline)
        return proc.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher
        for pid in _pids_running(str(script)):  # its workers, in sessions of their own
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        return None, out, time.monotonic() - t0


@pytest.mark.timeout(150)
def test_a_timed_out_reduction_ends_the_job(tmp_path):
    rc, out, seconds = _torchrun(tmp_path, "plain")
    assert rc is not None, f"still running after {seconds:.0f} s (the communication thread kept it alive):\n{out[-3000:]}"
    assert rc != 0
    assert "did not finish within 5 s" in out, out[-3000:]


@pytest.mark.timeout(150)
def test_join_finishes_a_job_with_uneven_inputs(tmp_path):
    rc, out, _ = _torchrun(tmp_path, "join")
    assert rc == 0, out[-3000:]
    assert "rank 0 finished: 2 ranks, 1 shadowed" in out and "rank 1 finished: 2 ranks, 0 shadowed" in out
