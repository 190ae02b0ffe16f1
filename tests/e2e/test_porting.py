"""docs/porting-from-ddp.md's two scripts under torchrun (2 workers, Gloo, MNIST): the port at width 1
is DDP bit for bit, and at width 2 a run resumed from its epoch-1 snapshots (which carry the
engine's in-flight update) ends bit-identical to an uninterrupted one."""

import os
import re
import subprocess
import sys

import pytest
from runs import ROOT


def torchrun(tmp_path, script: str, *args: str, snapshot: str) -> str:
    """The script's final line's parameter sha256 (rank 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "examples" / script), "--max-steps-per-epoch", "4", "--test-samples", "500",
                        "--snapshot", str(tmp_path / snapshot), *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr[-2000:]
    return re.search(r"final params sha256 ([0-9a-f]{64}) test accuracy [\d.]+%", r.stdout).group(1)


@pytest.mark.timeout(300)
def test_the_port_at_width_1_is_ddp_bit_for_bit(tmp_path, shared_data):
    data = ("--data-root", str(shared_data), "--epochs", "2")
    ddp = torchrun(tmp_path, "ddp_tutorial.py", *data, snapshot="ddp.pt")
    assert torchrun(tmp_path, "ddp_tutorial_pipesgd.py", *data, "--width", "1", snapshot="pipe.pt") == ddp


@pytest.mark.timeout(400)
@pytest.mark.parametrize("staleness", ["none", "lookahead"])
def test_the_port_resumes_from_its_snapshot_exactly(tmp_path, shared_data, staleness):
    """lookahead's snapshot also holds this rank's own in-flight gradient, which the other rank's
    does not: resuming exactly needs each rank's file (and forward_context() for the rule to act)."""
    data = ("--data-root", str(shared_data), "--width", "2", "--staleness", staleness)
    whole = torchrun(tmp_path, "ddp_tutorial_pipesgd.py", *data, "--epochs", "2", snapshot="whole.pt")
    first = torchrun(tmp_path, "ddp_tutorial_pipesgd.py", *data, "--epochs", "1", snapshot="split.pt")
    assert first != whole
    assert torchrun(tmp_path, "ddp_tutorial_pipesgd.py", *data, "--epochs", "2", snapshot="split.pt") == whole
