"""The examples that end in the lab's sweep report (``python -m pipesgd_lab.report sweep``), run
as their docstrings say: examples/sweep.sh and the headline table script that drives it (the
observability tests run sweep.sh on its own)."""

import re
import sys

import pytest
from runs import CACHE, ROOT
from runs import run_script as run

EXAMPLES = ROOT / "examples"


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
