"""The ring at larger p (issue #28, part 2; docs/ring-scaling.md): the grid holds every algorithm at
every p, link and size, and a bench cell predicts with its own algorithm's declared cost."""

import json
import random

import pytest

from pipesgd.bench import runner
from pipesgd.bench.__main__ import main as bench_main
from pipesgd.bench.grid import (
    GRIDS,
    RING_SCALING_ALGOS,
    RING_SCALING_BYTES,
    RING_SCALING_LINKS,
    RING_SCALING_WORLD_SIZES,
    Cell,
    full_grid,
    ring_scaling_grid,
)
from pipesgd.timing import Link, allreduce_time, comm_time

TRUE = {"100mbit": (300e-6, 8 / 0.96e8), "1gbit": (120e-6, 8 / 0.93e9)}
"""(α, β) the synthetic cells are generated with: not the calibration's."""
GAMMA = 2e-10
CALIBRATED = {"100mbit": (150e-6, 8 / 1e8), "1gbit": (60e-6, 8 / 1e9)}


def _calibration(link: str) -> dict:
    alpha, beta = CALIBRATED[link]
    return {"file": f"/cal/resnet20-p2-{link}.json", "alpha_s": alpha, "beta_s_per_byte": beta,
            "gamma_s_per_byte": GAMMA}


def _record(cell: Cell, ms: float, commit: str = "abc1234", mtu: int | None = 9000, repeats: int = 10) -> dict:
    mtu_opt = "" if mtu is None else f" --mtu {mtu}"
    return {"name": cell.name, "kind": "allreduce", "mode": cell.mode, "world_size": cell.world_size,
            "link": cell.link, "bytes": cell.nbytes, "commit": commit, "median_iter_ms": ms, "n": repeats,
            "config": {"quick": False, "cpus": 2, "threads_per_worker": 1, "overrides": [], "allreduce_repeats": repeats},
            "calibration": _calibration(cell.link),
            "command": f"python -m pipesgd.emulate --workers {cell.world_size} --rate {cell.link}{mtu_opt} "
                       f"--module pipesgd.bench.allreduce -- algo={cell.mode} bytes={cell.nbytes}"}


def _model_ms(cell: Cell, alpha: float, beta: float) -> float:
    return comm_time(cell.mode, cell.nbytes, cell.world_size, Link(alpha, beta, GAMMA)) * 1e3


def _exact(noise: float = 0.0, seed: int = 0, **kw) -> list[dict]:
    rng = random.Random(seed)
    return [_record(c, _model_ms(c, *TRUE[c.link]) * (1 + rng.gauss(0, noise)), **kw) for c in ring_scaling_grid()]


# --- grid and bench -----------------------------------------------------------------------------------


def test_ring_scaling_grid_holds_every_algorithm_p_link_and_size():
    cells = ring_scaling_grid()
    assert RING_SCALING_ALGOS == ("ring", "tree", "native") and RING_SCALING_WORLD_SIZES == (4, 8, 16)
    assert RING_SCALING_LINKS == ("100mbit", "1gbit")
    assert min(RING_SCALING_BYTES) == 1_000_000 and max(RING_SCALING_BYTES) == 100_000_000
    assert len(cells) == 3 * 3 * 2 * len(RING_SCALING_BYTES) == len({c.name for c in cells})
    assert {(c.mode, c.world_size, c.link, c.nbytes) for c in cells} == {
        (a, p, lk, b) for a in RING_SCALING_ALGOS for p in RING_SCALING_WORLD_SIZES for lk in RING_SCALING_LINKS
        for b in RING_SCALING_BYTES}
    assert all(c.kind == "allreduce" and c.emulated for c in cells)
    assert "allreduce/p16/100mbit/tree-100MB" in {c.name for c in cells}
    # Every cell predicts from its link's p=2 calibration: no ResNet-20 calibration at p=16.
    assert {c.calibration_key for c in cells} == {("resnet20", 2, "100mbit"), ("resnet20", 2, "1gbit")}
    # The suite's own allreduce cells keep their own p's calibration.
    assert Cell("allreduce", "ring", 4, "1gbit", nbytes=8_000_000).calibration_key == ("resnet20", 4, "1gbit")


def test_bench_lists_the_grid_it_is_given(capsys):
    assert set(GRIDS) >= {"full", "ring-scaling"}
    assert bench_main(["--grid", "ring-scaling", "--list"]) == 0
    assert capsys.readouterr().out.split() == [c.name for c in ring_scaling_grid()]
    assert bench_main(["--grid", "ring-scaling", "--list", "--only", "allreduce/p16/*/tree-*"]) == 0
    assert capsys.readouterr().out.split() == [f"allreduce/p16/{lk}/tree-{mb}MB" for lk in RING_SCALING_LINKS
                                               for mb in (1, 3, 10, 30, 100)]
    assert bench_main(["--list"]) == 0
    assert capsys.readouterr().out.split() == [c.name for c in full_grid()]


def test_an_allreduce_cell_is_predicted_by_its_own_algorithms_cost(tmp_path, monkeypatch):
    """The tree's cell is priced as a tree (2⌈log2 p⌉ whole-gradient steps), not as a ring."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 1e-10,
                               "compress_s_per_byte": {}, "compute_ms": 1.0, "update_ms": 0.1}))

    def fake_run(cmd, log_path, timeout_s, env=None, append=False):
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("hydra.run.dir="))
        (runner.Path(out) / "allreduce.json").write_text(json.dumps({
            "bytes": 1_000_000, "seconds": [0.5, 0.6, 0.7], "cpu_cores_per_rank": [{"user": 0.1, "system": 0.1}]}))

    monkeypatch.setattr(runner, "run_logged", fake_run)
    settings = runner.Settings(bench_dir=tmp_path, allreduce_repeats=3)
    (tmp_path / "cells" / "allreduce_p8_loopback_tree-1MB").mkdir(parents=True)
    record = runner.run_allreduce_cell(Cell("allreduce", "tree", 8, "loopback", nbytes=1_000_000), cal, settings)
    tree = allreduce_time("tree", 1_000_000, 8, 1e-4, 8e-8, 1e-10) * 1e3
    assert record["predicted_iter_ms"] == pytest.approx(tree)
    assert tree == pytest.approx(6 * (0.1 + 80.0) + 0.3, rel=1e-6)  # 3 rounds up, 3 down, 3 MB added
    assert record["rel_error"] == pytest.approx((tree - 600.0) / 600.0)
