"""The benchmark suite end to end: one tiny real cell of each kind written to JSON with every field and
rendered to markdown (its machinery without a run: tests/lab/test_bench_grid.py)."""

from __future__ import annotations

import json
import sys

import pytest
from runs import CACHE

from pipesgd_lab.bench.__main__ import main as bench_main
from pipesgd_lab.bench.grid import MLP, RESNET20, Cell
from pipesgd_lab.bench.render import BEGIN, END, write_markdown
from pipesgd_lab.bench.runner import Settings, run_cells, save

REQUIRED = {"name", "mode", "compressor", "world_size", "link", "n", "median_iter_ms", "min_iter_ms",
            "max_iter_ms", "predicted_iter_ms", "rel_error", "command", "commit", "config"}


def _calibration(path, params: int, batch: int) -> None:
    path.write_text(json.dumps({
        "alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 1e-11, "compress_s_per_byte": {"int8": 1e-9},
        "compute_ms": 2.0, "update_ms": 0.5, "overlap_slowdown": 1.1, "model_params": params, "batch_size": batch}))


@pytest.mark.timeout(240)
def test_one_tiny_cell_of_each_kind_end_to_end(tmp_path, shared_data):
    cals = tmp_path / "cal"
    cals.mkdir()
    _calibration(cals / "mlp-p2-loopback.json", MLP.params, MLP.batch_size)
    _calibration(cals / "resnet20-p2-loopback.json", RESNET20.params, RESNET20.batch_size)
    settings = Settings(bench_dir=tmp_path / "bench", steps=2, skip=1, repeats=1, allreduce_repeats=3, quick=True,
                        calibration_dir=cals, python=sys.executable, timeout_s=200, probe_s=0.05,
                        overrides=[f"data.root={shared_data}", f"data.cache_dir={CACHE}"])
    cells = [Cell("train", "pipe", 2, "loopback", "none", 2, "mlp"),
             Cell("allreduce", "ring", 2, "loopback", nbytes=4096)]
    records = list(run_cells(cells, settings))
    for record in records:
        assert "error" not in record, record.get("error")
        assert REQUIRED <= record.keys(), REQUIRED - record.keys()
        assert record["min_iter_ms"] <= record["median_iter_ms"] <= record["max_iter_ms"]
        assert record["calibration"]["file"].startswith(str(cals))
    train, allreduce = records
    assert train["n"] == 2 and train["predicted_from"] == "calibration"
    assert [sorted(h) for h in train["host_speed"]] == [["after", "before"]], "probed before and after its run"
    assert train["host_speed"][0]["before"]["gflops"] > 0
    # pipe, comm far faster than compute: the model says compute + update, from the calibration.
    assert train["predicted_iter_ms"] == pytest.approx(2.5, rel=0.2)
    assert train["command"].startswith("python -m pipesgd.train ") and "trainer.max_steps=3" in train["command"]
    assert allreduce["n"] == 3 and allreduce["bytes"] == 4096 and allreduce["bound_ms"] is None

    out, md = tmp_path / "benchmarks.json", tmp_path / "benchmarks.md"
    save(out, records)
    md.write_text("# Benchmarks\n\nnarrative before\n\n" + BEGIN + "\nold\n" + END + "\n\nnarrative after\n")
    write_markdown(md, json.loads(out.read_text()))
    assert bench_main(["--render-only", "--out", str(out), "--md", str(md)]) == 0
    text = md.read_text()
    assert "narrative before" in text and "narrative after" in text and "\nold\n" not in text
    assert "| mlp/p2/loopback/pipe * |" in text and "| allreduce/p2/loopback/ring-4.096KB * |" in text
    assert text.count(BEGIN) == 1


def test_local_mode_steps_without_communication():
    """trainer.mode=local, the compute-only baseline: a plain optimizer step, nothing on the wire."""
    import torch

    from pipesgd.compress import get_compressor
    from pipesgd.engine import ModeArgs
    from pipesgd.engine.build import build

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    same, engine = build("local", ModeArgs(model, opt, 2, get_compressor("none"), None, None, 4, 0,
                                           torch.device("cpu")))
    assert same is model and engine.width == 1
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    stats = engine.step()
    assert stats.applied and stats.comm.wire_bytes == 0
    assert torch.equal(model.weight, before - 1.0)


