"""``destroy_process_group()`` ends Gloo's threads in a script that imported pipesgd first, even
after building an optimizer (which imports ``torch.distributed.nn``, whose default arguments would
otherwise hold the default group: pipesgd/teardown.py), through the engine or the DDP hook. Left running into interpreter exit,
those threads aborted a finished job (SIGABRT) about one run in eight on a loaded host. The hook's
state holds its DDP model weakly: held strongly, the reducer -> state -> model cycle runs through
C++, which Python's collector cannot see, and ``del`` freed neither the model nor any group."""

import subprocess
import sys

import pytest
from distributed_utils import free_port
from runs import ROOT

SCRIPT = """
import os, sys, torch, torch.distributed as dist
if sys.argv[2] == "engine":
    from pipesgd import PipeSGD  # before the group, as a training script imports it
else:
    from pipesgd.hooks import register

def threads():
    return len(os.listdir("/proc/self/task"))

alone = threads()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
assert threads() > alone, "Gloo started no thread: the check below would prove nothing"
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[2] == "engine":
    engine = PipeSGD(optimizer, model.parameters(), width=2)
    model(torch.randn(8, 4)).sum().backward()
    engine.step()
    engine.flush()
    engine.close()
else:
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = register(ddp)
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    state.flush(optimizer)
    del ddp, state  # DDP holds its group, the state its two: both go when the script lets go of them
total = torch.ones(1)
dist.all_reduce(total)
dist.destroy_process_group()
print("threads", alone, threads(), flush=True)  # alone, after destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way_in", ["engine", "hook"])
def test_destroy_process_group_ends_the_gloo_threads_after_an_optimizer_was_built(way_in):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), way_in], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"})
    assert out.returncode == 0, out.stdout + out.stderr
    alone, after = (int(w) for w in next(l for l in out.stdout.splitlines() if l.startswith("threads ")).split()[1:])
    assert after == alone, f"{after} threads after destroy_process_group(), {alone} before init: the group outlived it"
