"""The examples run as their docstrings say, for a few steps: the README's ten-line example and the
plain loop under torchrun (2 workers, Gloo) and on its synthetic fallback. The two that end in the
lab's sweep report (sweep.sh, headline_table.py) run in tests/lab/test_sweep_examples.py."""

import re
import sys

import pytest
from runs import ROOT
from runs import run_script as run

EXAMPLES = ROOT / "examples"


@pytest.mark.timeout(120)
def test_readme_example_block_is_ten_lines_and_runs():
    text = (EXAMPLES / "minimal.py").read_text()
    block = text.split("# --- README example ---\n")[1].split("# --- end README example ---")[0]
    assert len(block.strip().splitlines()) == 10
    r = run(sys.executable, str(EXAMPLES / "minimal.py"))
    assert r.returncode == 0, r.stderr[-2000:]
    loss = float(re.search(r"final loss ([\d.]+) after 200 steps", r.stdout).group(1))
    assert loss < 0.5, "the student learns the teacher (chance is ln 4 = 1.39)"


@pytest.mark.timeout(240)
def test_plain_loop_under_torchrun_learns_mnist(shared_data):
    r = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(EXAMPLES / "plain_loop.py"), "--steps", "40", "--log-every", "20", "--data-root", str(shared_data))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[rank 1]" not in r.stderr, "other ranks are silent"
    m = re.search(r"test accuracy ([\d.]+)% after 40 steps on 2 worker\(s\), width 2", r.stderr)
    assert m, r.stderr[-2000:]
    assert float(m.group(1)) > 50.0


@pytest.mark.timeout(120)
def test_plain_loop_falls_back_to_synthetic_data(tmp_path):
    r = run(sys.executable, str(EXAMPLES / "plain_loop.py"), "--steps", "30", "--log-every", "10",
            "--data-root", str(tmp_path), "--compressor", "int8", "--width", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "MNIST not found: looked for" in r.stderr and "training on synthetic data instead" in r.stderr
    assert "test accuracy" in r.stderr and "on 1 worker(s), width 3, compressor int8" in r.stderr
