"""The examples run as their docstrings say, for a few steps: the README's ten-line example, the
plain loop under torchrun (2 workers, Gloo) and on its synthetic fallback, the headline table
script (which drives examples/sweep.sh; the observability tests run sweep.sh on its own)."""

import os
import re
import subprocess
import sys

import pytest
from runs import CACHE, ROOT

EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHON=sys.executable)
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


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


@pytest.mark.timeout(30)
def test_sweep_script_needs_an_output_dir():
    r = run("bash", str(EXAMPLES / "sweep.sh"))
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.timeout(480)
def test_headline_table_quick(tmp_path, shared_data):
    out = tmp_path / "headline"
    r = run(sys.executable, str(EXAMPLES / "headline_table.py"), "--quick", "--out", str(out), "--",
            f"data.root={shared_data}", f"data.cache_dir={CACHE}", timeout=460)
    assert r.returncode == 0, r.stderr[-3000:]
    table = (out / "headline.md").read_text()
    assert r.stdout == table
    rows = [line for line in table.splitlines()[2:]]
    assert [row.split(" | ")[0] for row in rows] == [
        "| sync allreduce SGD", "| PyTorch DDP", "| Pipe-SGD (width 2)", "| Pipe-SGD + fp16", "| Pipe-SGD + int8"]
    assert rows[0].split(" | ")[4] == "1.00x"
    assert all(re.fullmatch(r"\| .+ \| 2 \| [\d.]+% \| [\d.]+ \| [\d.]+x \| \d+ \|", row) for row in rows), rows
    assert (out / "sweep.md").exists() and (out / "sweep_breakdown.png").exists()
