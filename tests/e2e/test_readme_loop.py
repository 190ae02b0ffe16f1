"""The README's library loop is a complete, correct program: run verbatim under torchrun (2 workers,
Gloo) with a model, optimizer, loss and uneven loaders defined around it, then resumed from the
checkpoint it writes."""

import os
import re
import subprocess
import sys

import pytest
from runs import ROOT

PRELUDE = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = torch.nn.functional.cross_entropy
import os
rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(rank)
loader = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(6 + rank)]
"""

CHECK = """
engine.close()
saved = torch.load(f"checkpoint-rank{dist.get_rank()}.pt")
model.load_state_dict(saved["model"])
optimizer.load_state_dict(saved["optimizer"])
again = PipeSGD(optimizer, model.parameters(), width=2, module=model, staleness="lookahead")
again.load_state_dict(saved["engine"])
again.close()
print(f"rank {dist.get_rank()}: {engine.steps} steps, {engine.shadowed} shadowed, resumed at {again.steps}", flush=True)
dist.destroy_process_group()  # as the README's last line says: a group left to interpreter exit can abort it
"""


def readme_loop() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it in your own loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(180)
def test_the_readme_loop_runs_under_torchrun(tmp_path):
    script = tmp_path / "readme_loop.py"
    script.write_text(PRELUDE + readme_loop() + CHECK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0: 7 steps, 1 shadowed, resumed at 7" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "rank 1: 7 steps, 0 shadowed, resumed at 7" in r.stdout
    assert "Warning" not in r.stderr, r.stderr[-2000:]
