"""``destroy_process_group()`` ends Gloo's threads in a script that imported pipesgd first, even
after building an optimizer (which imports ``torch.distributed.nn``, whose default arguments would
otherwise hold the default group: pipesgd/comm/teardown.py). Left running into interpreter exit,
those threads aborted a finished job (SIGABRT) about one run in eight on a loaded host."""

import subprocess
import sys

import pytest
from distributed_utils import free_port
from runs import ROOT

SCRIPT = """
import os, sys, torch, torch.distributed as dist
from pipesgd import PipeSGD  # before the group, as a training script imports it

def threads():
    return len(os.listdir("/proc/self/task"))

alone = threads()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
assert threads() > alone, "Gloo started no thread: the check below would prove nothing"
model = torch.nn.Linear(4, 3)
engine = PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=2)
model(torch.randn(8, 4)).sum().backward()
engine.step()
engine.flush()
total = torch.ones(1)
dist.all_reduce(total)
engine.close()
dist.destroy_process_group()
print(f"threads: {alone} alone, {threads()} after destroy_process_group", flush=True)
"""


@pytest.mark.timeout(120)
def test_destroy_process_group_ends_the_gloo_threads_after_an_optimizer_was_built(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"})
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("threads:"))
    alone, after = (int(w) for w in line.replace(",", "").split() if w.isdigit())
    assert after == alone, f"{line}: the process group outlived destroy_process_group()"
