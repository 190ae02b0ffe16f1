"""The ring at larger p (docs/ring-scaling.md), on synthetic cells: the grid holds
every algorithm at every p, link and size; a bench cell predicts with its own algorithm's declared
cost; the fit recovers the link's α and β from cells the α–β model generated (exactly, and within
the noise when noisy), reports every cell's errors and the medians per p band, lists missing and
failed cells, and refuses inputs that mix commits, MTUs, settings or calibrations."""

import json
import random
import statistics

import pytest

from pipesgd_lab.bench import ring_fit as rf
from pipesgd_lab.bench import runner
from pipesgd_lab.bench import render as bench_render
from pipesgd_lab.bench.__main__ import main as bench_main
from pipesgd_lab.bench.grid import (
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
            "gamma_s_per_byte": GAMMA, "compute_ms": 150.0, "update_ms": 2.0}


def _record(cell: Cell, ms: float, commit: str = "abc1234", mtu: int | None = 9000, repeats: int = 10) -> dict:
    mtu_opt = "" if mtu is None else f" --mtu {mtu}"
    return {"name": cell.name, "kind": "allreduce", "mode": cell.mode, "world_size": cell.world_size,
            "link": cell.link, "bytes": cell.nbytes, "commit": commit, "median_iter_ms": ms, "n": repeats,
            "min_iter_ms": ms, "max_iter_ms": ms, "predicted_iter_ms": ms, "rel_error": 0.0, "date": "2026-11-25",
            "loadavg_before": [1.0, 1.0, 1.0], "rank_cpu_cores": {"user": 0.1, "system": 0.2},
            "config": {"quick": False, "cpus": 2, "threads_per_worker": 1, "overrides": [],
                       "allreduce_repeats": repeats},
            "calibration": _calibration(cell.link),
            "command": f"python -m pipesgd_lab.emulate --workers {cell.world_size} --rate {cell.link}{mtu_opt} "
                       f"--module pipesgd_lab.bench.allreduce -- algo={cell.mode} bytes={cell.nbytes}"}


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


# --- the fit ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["ring", "tree", "native"])
@pytest.mark.parametrize("p", [4, 16])
def test_coefficients_are_the_models_own_prices(algo, p):
    a, b, g = rf.coefficients(algo, 3e6, p)
    assert a * 2e-4 + b * 3e-9 + g * 5e-10 == pytest.approx(comm_time(algo, 3e6, p, Link(2e-4, 3e-9, 5e-10)), rel=1e-12)


def test_fit_recovers_the_links_constants_from_exact_cells():
    report = rf.analyse(_exact())
    for link, (alpha, beta) in TRUE.items():
        fits = report["links"][link]
        for fit in (fits["shared"], *fits["per_algo"].values()):
            assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
            assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
            assert not fit["constrained"]
        assert fits["shared"]["cells"] == 3 * 2 * len(RING_SCALING_BYTES)  # p=4 and 8, every algorithm
        assert fits["calibrated"]["alpha_s"] == CALIBRATED[link][0]
    medians = report["median_abs_error"]
    assert set(medians["shared"]["all"]) == {"p<=8", "p>8"}
    for band in ("p<=8", "p>8"):  # p=16 is predicted out of sample, as exactly
        assert medians["shared"]["all"][band] < 1e-9 and medians["per_algo"]["all"][band] < 1e-9
        assert medians["calibrated"]["all"][band] > 0.01  # the calibration is not what generated the cells
    assert len(report["cells"]) == 90 and not report["missing"] and not report["failed"]


@pytest.mark.parametrize("seed", range(5))
def test_fit_stays_within_the_noise(seed):
    """3 % multiplicative noise: β within 2 %, both constants within four of their standard errors
    (over 60 seeds (fit − truth) / error has a spread near 1 and stays below 3.1), α's error large
    at 100 Mbit/s (α is a per cent or two of a 1 MB cell there), and the shared fit's median error
    near the noise's (median |N(0, 3 %)| ≈ 2 %)."""
    report = rf.analyse(_exact(noise=0.03, seed=seed))
    for link, (alpha, beta) in TRUE.items():
        shared = report["links"][link]["shared"]
        assert shared["beta_s_per_byte"] == pytest.approx(beta, rel=0.02)
        assert abs(shared["beta_s_per_byte"] - beta) < 4 * shared["beta_se_s_per_byte"]
        assert abs(shared["alpha_s"] - alpha) < 4 * shared["alpha_se_s"]
    assert report["links"]["1gbit"]["shared"]["alpha_se_s"] < TRUE["1gbit"][0]  # 1 Gbit/s does pin α
    assert report["median_abs_error"]["shared"]["all"]["p<=8"] < 0.03


def test_an_algorithm_off_its_declared_cost_shows_in_its_own_fit():
    """native 10 % slower than the ideal ring it is priced as: its own fit's 1/β is 10 % lower than
    the others', and with --fit-algos ring,tree the shared constants are the true ones and native's
    cells are predicted 1/1.1 − 1 ≈ −9 % off."""
    records = [_record(c, _model_ms(c, *TRUE[c.link]) * (1.1 if c.mode == "native" else 1.0))
               for c in ring_scaling_grid()]
    report = rf.analyse(records, fit_algos=["ring", "tree"])
    assert report["fit_algos"] == ["ring", "tree"]
    for link, (alpha, beta) in TRUE.items():
        fits = report["links"][link]
        assert fits["shared"]["cells"] == 2 * 2 * len(RING_SCALING_BYTES)
        assert fits["shared"]["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
        # γ stays the calibrated one, so native's β also takes 0.1·γ·G/B, with G/B = 1/2 for a ring.
        assert fits["per_algo"]["native"]["beta_s_per_byte"] == pytest.approx(1.1 * beta + 0.1 * GAMMA / 2, rel=1e-9)
    native = [c["rel_error"]["shared"] for c in report["cells"] if c["algo"] == "native"]
    assert native == pytest.approx([1 / 1.1 - 1] * 30)
    assert rf.analyse(records)["links"]["1gbit"]["shared"]["beta_s_per_byte"] > TRUE["1gbit"][1] * 1.01


def test_fit_minimises_relative_not_absolute_residuals():
    """A 10 ms cell counts as much as a second one: with the 100 MB cell 20 % fast, the fit keeps the
    1 MB cell's relative error far below what ordinary least squares (absolute residuals, led by
    the 100 MB cell) leaves it, and no nearby (α, β) has a smaller sum of squared relative errors."""
    np = pytest.importorskip("numpy")
    cells = [c for c in ring_scaling_grid() if c.link == "1gbit" and c.mode == "ring" and c.world_size == 4]
    samples = rf.samples_of([_record(c, _model_ms(c, *TRUE["1gbit"]) * (0.8 if c.nbytes == 100_000_000 else 1.0))
                             for c in cells])
    fit = rf.fit_alpha_beta(samples, GAMMA)
    assert not fit["constrained"]

    def rel_sse(alpha, beta):
        return sum(rf.rel_error(s.predict(alpha, beta, GAMMA), s.seconds) ** 2 for s in samples)

    best = rel_sse(fit["alpha_s"], fit["beta_s_per_byte"])
    for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        assert best < rel_sse(fit["alpha_s"] * (1 + 1e-3 * da), fit["beta_s_per_byte"] * (1 + 1e-3 * db))
    ols, *_ = np.linalg.lstsq(np.array([[s.a, s.b] for s in samples]),
                              np.array([s.seconds - s.g * GAMMA for s in samples]), rcond=None)
    small = samples[0]
    assert small.nbytes == 1_000_000
    ours = abs(rf.rel_error(small.predict(fit["alpha_s"], fit["beta_s_per_byte"], GAMMA), small.seconds))
    theirs = abs(rf.rel_error(small.predict(*ols, GAMMA), small.seconds))
    assert ours < 0.1 < theirs


def test_fit_needs_two_cells_that_tell_alpha_from_beta():
    cell = next(c for c in ring_scaling_grid() if c.link == "1gbit")
    one = rf.samples_of([_record(cell, 10.0)])
    with pytest.raises(rf.FitError, match="1 cell"):
        rf.fit_alpha_beta(one, GAMMA)
    with pytest.raises(rf.FitError, match="do not tell"):
        rf.fit_alpha_beta(one * 2, GAMMA)


def test_a_negative_constant_is_held_at_zero():
    cells = [c for c in ring_scaling_grid() if c.link == "1gbit" and c.mode == "ring" and c.world_size == 4]
    # Pure bandwidth with the small cells a little fast: unconstrained, α would come out negative.
    recs = [_record(c, _model_ms(c, 0.0, 8e-9) * (0.9 if c.nbytes == 1_000_000 else 1.0)) for c in cells]
    fit = rf.fit_alpha_beta(rf.samples_of(recs), GAMMA)
    assert fit["constrained"] and fit["alpha_s"] == 0.0 and fit["beta_s_per_byte"] > 0


def test_residuals_and_medians():
    assert rf.rel_error(110.0, 100.0) == pytest.approx(0.10)
    assert rf.rel_error(90.0, 100.0) == pytest.approx(-0.10)
    assert rf.median_abs([0.1, -0.3, None, 0.2]) == pytest.approx(0.2)
    assert rf.median_abs([None]) is None
    report = rf.analyse(_exact())
    cell = next(c for c in report["cells"] if c["name"] == "allreduce/p8/100mbit/tree-10MB")
    alpha, beta = CALIBRATED["100mbit"]
    calibrated = allreduce_time("tree", 10_000_000, 8, alpha, beta, GAMMA) * 1e3
    assert cell["predicted_ms"]["calibrated"] == pytest.approx(calibrated)
    assert cell["rel_error"]["calibrated"] == pytest.approx((calibrated - cell["measured_ms"]) / cell["measured_ms"])
    band = [abs(c["rel_error"]["calibrated"]) for c in report["cells"] if c["link"] == "100mbit" and c["p"] <= 8]
    assert report["median_abs_error"]["calibrated"]["100mbit"]["p<=8"] == pytest.approx(statistics.median(band))


# --- partial and mixed inputs ---------------------------------------------------------------------------


def test_partial_input_reports_missing_and_failed_cells():
    records = [r for r in _exact() if "/1gbit/" not in r["name"] or "/p16/" in r["name"]]
    records = [r for r in records if r["name"] != "allreduce/p4/100mbit/ring-1MB"]
    broken = next(r for r in records if r["name"] == "allreduce/p8/100mbit/native-3MB")
    broken.pop("median_iter_ms")
    broken["error"] = "exit status 1 from python -m pipesgd_lab.emulate"
    records.append({"name": "resnet20/p2/100mbit/sync", "kind": "train"})  # another grid's cell: left out
    report = rf.analyse(records)
    assert "allreduce/p4/100mbit/ring-1MB" in report["missing"]
    assert "allreduce/p4/1gbit/tree-1MB" in report["missing"] and len(report["missing"]) == 1 + 30
    assert report["failed"] == [{"name": "allreduce/p8/100mbit/native-3MB", "error": broken["error"]}]
    assert report["links"]["100mbit"]["shared"]["alpha_s"] == pytest.approx(TRUE["100mbit"][0], rel=1e-6)
    # 1gbit: only p=16 measured, so nothing to fit on; its cells are still listed, unpredicted.
    assert "0 cell(s)" in report["links"]["1gbit"]["shared"]["error"]
    p16 = next(c for c in report["cells"] if c["name"] == "allreduce/p16/1gbit/ring-1MB")
    assert p16["predicted_ms"]["shared"] is None and p16["predicted_ms"]["calibrated"] is not None
    text = rf.render(report)
    assert "no fit: 0 cell(s)" in text and "`allreduce/p4/100mbit/ring-1MB`" in text
    assert "| allreduce/p8/100mbit/native-3MB | exit status 1" in text
    assert rf.render(rf.analyse([])).count("(no cells)") >= 2  # nothing measured: a report, not a crash


@pytest.mark.parametrize("change, what", [
    (dict(commit="def5678"), "different commits: \"abc1234\""),
    (dict(mtu=None), "link MTUs.*9000.*1500"),
])
def test_mixed_commits_or_mtus_are_refused(change, what):
    records = _exact()
    odd = ring_scaling_grid()[7]
    records[7] = _record(odd, 5.0, **change)
    with pytest.raises(rf.Refused, match=what) as e:
        rf.analyse(records)
    assert odd.name in str(e.value)


def test_a_dirty_tree_is_a_different_commit_unless_accepted_and_then_listed():
    records = _exact()
    odd = ring_scaling_grid()[5]
    records[5] = _record(odd, records[5]["median_iter_ms"], commit="abc1234-dirty")
    with pytest.raises(rf.Refused, match="different commits"):
        rf.analyse(records)
    report = rf.analyse(records, accept_dirty=True)
    assert report["setup"]["commit"] == "abc1234" and report["setup"]["dirty_cells"] == [odd.name]
    assert "1 cells from a modified tree at that commit, accepted with --accept-dirty" in rf.render(report)
    records[6] = _record(ring_scaling_grid()[6], 5.0, commit="def5678-dirty")  # another commit stays refused
    with pytest.raises(rf.Refused, match="different commits"):
        rf.analyse(records, accept_dirty=True)
    assert rf.analyse(_exact())["setup"]["dirty_cells"] == [] and "modified tree" not in rf.render(rf.analyse(_exact()))
    # every cell dirty at one commit is one setup without the flag, and the note does not claim the flag
    same = [_record(c, r["median_iter_ms"], commit="abc1234-dirty") for c, r in zip(ring_scaling_grid(), _exact())]
    report = rf.analyse(same)
    assert report["setup"]["commit"] == "abc1234-dirty" and report["setup"]["dirty_cells"] == []
    assert "--accept-dirty" not in rf.render(report)


def test_mixed_settings_or_calibrations_are_refused_but_repeats_may_differ():
    records = _exact()
    records[3]["config"]["quick"] = True
    with pytest.raises(rf.Refused, match=r"settings \(quick\)"):
        rf.analyse(records)
    records = _exact()
    records[4]["calibration"] = dict(records[4]["calibration"], file="/elsewhere/resnet20-p2-100mbit.json")
    with pytest.raises(rf.Refused, match="calibrations of link 100mbit"):
        rf.analyse(records)
    big = [_record(c, _model_ms(c, *TRUE[c.link]), repeats=3 if c.nbytes >= 30_000_000 else 10)
           for c in ring_scaling_grid()]
    assert len(rf.analyse(big)["cells"]) == 90


# --- the command ------------------------------------------------------------------------------------------


def test_command_writes_the_fit_the_section_and_the_plot(tmp_path, caplog):
    inp, out, md, png = tmp_path / "cells.json", tmp_path / "fit.json", tmp_path / "ring.md", tmp_path / "img" / "r.png"
    inp.write_text(json.dumps(_exact(noise=0.02)))
    md.write_text(f"# Ring\n\nbefore\n\n{rf.BEGIN}\nstale\n{rf.END}\n\nafter\n")
    pytest.importorskip("matplotlib")
    assert rf.main(["--in", str(inp), "--out", str(out), "--md", str(md), "--plot", str(png)]) == 0
    fit = json.loads(out.read_text())
    assert fit["links"]["1gbit"]["shared"]["cells"] == 30 and len(fit["cells"]) == 90
    text = md.read_text()
    assert "before" in text and "after" in text and "stale" not in text and text.count(rf.BEGIN) == 1
    assert "| allreduce/p16/1gbit/tree-100MB |" in text and "p>8" in text
    assert png.stat().st_size > 10_000
    # Refused: exit 2, the message names both commits, nothing written.
    records = _exact()
    records[0]["commit"] = "fffffff"
    inp.write_text(json.dumps(records))
    out.unlink()
    assert rf.main(["--in", str(inp), "--out", str(out), "--md", str(md)]) == 2
    assert "fffffff" in caplog.text and "abc1234" in caplog.text and not out.exists()


def test_command_rejects_bad_options(tmp_path):
    with pytest.raises(SystemExit):
        rf.main(["--in", str(tmp_path / "x.json"), "--fit-algos", "ring,bogus"])
    with pytest.raises(SystemExit):
        rf.main(["--in", str(tmp_path / "x.json"), "--fit-max-p", "1"])
    assert rf.main(["--in", str(tmp_path / "absent.json"), "--out", str(tmp_path / "o.json"),
                    "--md", str(tmp_path / "o.md")]) == 2


def test_the_bench_and_the_fit_share_one_document(tmp_path):
    """docs/ring-scaling.md holds the fit's section and the bench's tables of the same cells: each
    command replaces only its own, and the narrative around them stays."""
    md, records = tmp_path / "ring-scaling.md", _exact()
    md.write_text(f"# Ring\n\nintro\n\n{rf.BEGIN}\nold fit\n{rf.END}\n\nmiddle\n\n"
                  f"{bench_render.BEGIN}\nold cells\n{bench_render.END}\n\nend\n")
    for _ in range(2):
        bench_render.write_markdown(md, records)
        rf.write_markdown(md, rf.render(rf.analyse(records)))
    text = md.read_text()
    assert [text.count(m) for m in (rf.BEGIN, rf.END, bench_render.BEGIN, bench_render.END)] == [1, 1, 1, 1]
    assert "old fit" not in text and "old cells" not in text
    assert text.index("intro") < text.index(rf.BEGIN) < text.index("middle") < text.index(bench_render.BEGIN) \
        < text.index("end")
    assert "| allreduce/p16/100mbit/tree-100MB | 100.00 |" in text  # the bench's allreduce table
    assert "| allreduce/p16/100mbit/tree-100MB |" in text.split(rf.END)[0]  # the fit's cell table
