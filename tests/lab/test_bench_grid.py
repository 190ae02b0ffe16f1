"""The benchmark suite's machinery without running a cell: the grid, the targets arithmetic, merging
results, the CPU split and recorded commands (tests/lab/test_bench.py runs one tiny real cell of each kind)."""

from __future__ import annotations

import pytest

from pipesgd_lab.bench.grid import LINKS, TRAIN_MODES, WORLD_SIZES, Cell, full_grid, quick_grid, select
from pipesgd_lab.bench.render import BEGIN, END, Results, render, targets
from pipesgd_lab.bench.runner import Settings, cpu_split, merge, recorded


def test_grid_covers_the_issue_and_names_are_unique():
    names = [c.name for c in full_grid()]
    assert len(names) == len(set(names))
    for link in LINKS:
        for p in WORLD_SIZES:
            for mode, comp in TRAIN_MODES:
                assert f"resnet20/p{p}/{link}/{mode}{'' if comp == 'none' else '-' + comp}" in names
            assert f"allreduce/p{p}/{link}/ring-1.08MB" in names and f"allreduce/p{p}/{link}/native-8MB" in names
    assert {"resnet20/p2/loopback/local", "mlp1m/p2/100mbit/pipe", "allreduce/p2/100mbit/ring-4.28MB"} <= set(names)
    assert {c.name for c in quick_grid()} <= set(names)
    # The seed papers' modes at 100 Mbit; hierarchical only where a node group can hold 2 of the ranks.
    for p in WORLD_SIZES:
        assert {f"resnet20/p{p}/100mbit/{m}" for m in ("sync+tree", "pipe+tree", "ps_sync", "ps_async")} <= set(names)
    assert [n for n in names if "hierarchical" in n] == ["resnet20/p4/100mbit/sync+hierarchical",
                                                          "resnet20/p4/100mbit/pipe+hierarchical"]
    hier = next(c for c in full_grid() if c.name == "resnet20/p4/100mbit/pipe+hierarchical")
    assert {"comm=hierarchical", "comm.group_size=2", "trainer.width=2", "dist.nproc=4"} <= set(hier.train_overrides)
    assert [c.name for c in select(full_grid(), "resnet20/p4/100mbit/pipe*")] == [
        "resnet20/p4/100mbit/pipe", "resnet20/p4/100mbit/pipe-fp16", "resnet20/p4/100mbit/pipe-bf16",
        "resnet20/p4/100mbit/pipe-int8", "resnet20/p4/100mbit/pipe+tree", "resnet20/p4/100mbit/pipe+hierarchical"]
    with pytest.raises(ValueError, match="nope"):
        select(full_grid(), "resnet20/*,nope")


def _cell(name: str, ms: float, **extra) -> dict:
    kind = "allreduce" if name.startswith("allreduce") else "train"
    parts = name.split("/")
    return {"name": name, "kind": kind, "mode": parts[3].split("-")[0], "world_size": int(parts[1][1:]),
            "link": parts[2], "workload": parts[0] if kind == "train" else None, "compressor": "none",
            "median_iter_ms": ms, "min_iter_ms": ms, "max_iter_ms": ms, "n": 1, "rel_error": 0.05, **extra}


def test_targets_are_computed_from_the_cells():
    ar = Cell("allreduce", "ring", 2, "100mbit", nbytes=4 * 1_068_810).name
    ring = Cell("allreduce", "ring", 2, "100mbit", nbytes=4 * 269_722).name
    cells = [_cell("resnet20/p2/100mbit/sync", 300.0), _cell("resnet20/p2/100mbit/pipe", 200.0),
             _cell("resnet20/p2/100mbit/ddp", 250.0), _cell("resnet20/p2/100mbit/pipe-int8", 190.0),
             _cell("resnet20/p2/loopback/local", 100.0), _cell("resnet20/p2/loopback/pipe", 102.0),
             _cell("mlp1m/p2/loopback/local", 2.0), _cell("mlp1m/p2/100mbit/pipe", 380.0),
             _cell(ar, 370.0, bytes=4 * 1_068_810, fraction_of_bound=0.93, rel_error=-0.2),
             _cell(ring, 90.0, bytes=4 * 269_722, fraction_of_bound=0.95)]
    rows = {r[0]: r for r in targets(Results(cells))}
    # ceiling: pipe replaced by max(compute-only 100, allreduce 90) = 100 ms.
    assert rows["p=2, 100mbit: pipe vs sync"][2:] == ["1.50x", "1.40×", "yes", "3.00x"]
    assert rows["p=2, 100mbit: pipe vs DDP"][2:] == ["1.25x", "1.30×", "**no**", "2.50x"]
    assert rows["p=2, 100mbit: pipe+int8 vs sync fp32"][2:] == ["1.58x", "1.50×", "yes", "–"]  # no ratio recorded
    assert rows["loopback p=2: framework overhead"][2] == "1.02x"
    assert rows["p=4, 100mbit: pipe vs sync"][4:] == ["–", "–"]
    comm_bound = rows["communication-bound (MLP 1.07M, p=2, 100mbit)"]
    assert comm_bound[2] == f"{380 / 370:.2f}x" and comm_bound[4] == "yes"
    assert rows["ring at 100mbit, p=2, 4.28 MB"][2:5] == ["93.0%", "90.0%", "yes"]
    assert rows["timing model, 8 training cells"][2] == "5.0%"
    assert rows["timing model, 10 cells of every kind"][2] == "5.0%"  # |0.05| x 9 and |-0.2|
    text = render(cells)
    assert text.startswith(BEGIN) and text.rstrip().endswith(END)


def test_merge_replaces_same_names_in_grid_order():
    order = ["a", "b", "c"]
    old = [{"name": "c", "v": 1}, {"name": "a", "v": 1}]
    assert merge(old, [{"name": "b", "v": 2}, {"name": "c", "v": 2}], order) == [
        {"name": "a", "v": 1}, {"name": "b", "v": 2}, {"name": "c", "v": 2}]


def test_cpu_split_fractions():
    # user nice system idle iowait irq softirq steal
    split = cpu_split([[50, 0, 20, 20, 0, 0, 10, 0], [50, 0, 20, 20, 0, 0, 10, 0]])
    assert split["user"] == pytest.approx(0.5) and split["system"] == pytest.approx(0.2)
    assert split["irq"] == pytest.approx(0.1) and split["idle"] == pytest.approx(0.2)
    assert cpu_split([]) is None


def test_commands_are_recorded_relative_to_the_repository_root(tmp_path):
    s = Settings(bench_dir=tmp_path / "outputs" / "bench" / "t", python="/venv/bin/python", root=tmp_path)
    cmd = ["/venv/bin/python", "-m", "pipesgd.train", f"hydra.run.dir={s.bench_dir}/cells/x/r0",
           f"timing.calibration={s.bench_dir}/calibration/c.json", "data.root=/data elsewhere"]
    assert recorded(cmd, s) == ("python -m pipesgd.train hydra.run.dir=outputs/bench/t/cells/x/r0 "
                                "timing.calibration=outputs/bench/t/calibration/c.json 'data.root=/data elsewhere'")
