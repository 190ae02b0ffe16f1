"""The pipelined DDP hook where Lightning users are: ``examples/lightning_pipelined.py`` trains on two
CPU processes through ``DDPStrategy`` and ends with the weights of the width-2 rule replayed in one
process (torch's fp16 hook arithmetic, applied one step late), and leaves no process behind."""

import os
import re
import subprocess
import sys
import uuid

import pytest
from runs import ROOT, tagged_processes

pytest.importorskip("pytorch_lightning", reason="Lightning is in the dev extra (pyproject.toml)")


@pytest.mark.timeout(240)
def test_lightning_ddp_strategy_runs_the_pipelined_hook(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", PIPESGD_TEST_TAG=uuid.uuid4().hex, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples/lightning_pipelined.py"), "--root", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"steps (\d+); weights moved ([\d.e+-]+); max \|Lightning - width-2 replay\| = ([\d.e+-]+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert int(m.group(1)) == 8, "the hook ran at every step"
    assert float(m.group(2)) > 1e-3, "the optimizer stepped"
    assert float(m.group(3)) <= 1e-6, "Lightning's DDP follows the width-2 rule"
    assert not tagged_processes(env["PIPESGD_TEST_TAG"])
