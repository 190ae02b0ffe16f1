"""The scale map (``python -m pipesgd.timing map``): it is the timing model's own prediction (the
measured ResNet-20 cells' recorded predictions, and ``predict``'s rows, come out of it unchanged),
PowerSGD's bytes follow torch's hook, every preset cites a source, and bad input is named."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipesgd.timing import Link, comm_time, predict
from pipesgd.timing.__main__ import main
from pipesgd.timing.presets import (
    COMPUTE,
    GPUS,
    LINKS,
    MODELS,
    compute_preset,
)
from pipesgd.reduction.powersgd import ddp_traffic
from pipesgd.timing.model import barriers_per_step
from pipesgd.timing.scale import ALL_ARMS, ARMS, Scenario, arm_rows, summarize

ROOT = Path(__file__).resolve().parents[2]
_ARM_OF = {(mode, width, comp): arm for arm, (mode, width, comp) in ARMS.items()}


def _measured_cells() -> list[dict]:
    """results/benchmarks/benchmarks.json's ResNet-20 cells that are map arms, with the calibration they
    predicted from."""
    cells = []
    for r in json.loads((ROOT / "results/benchmarks/benchmarks.json").read_text()):
        key = (r.get("mode"), r.get("width"), r.get("compressor"))
        if r.get("kind") == "train" and r.get("model") == "resnet20" and r.get("comm") == "ring" \
                and key in _ARM_OF and r.get("predicted_from") == "calibration":
            cells.append(r)
    return cells


def _scenario(cell: dict) -> Scenario:
    c = cell["calibration"]
    return Scenario(cell["params"], cell["world_size"], Link(c["alpha_s"], c["beta_s_per_byte"], c["gamma_s_per_byte"]),
                    c["compute_ms"] / 1e3, update_s=c["update_ms"] / 1e3, overlap_slowdown=c["overlap_slowdown"],
                    compress_s_per_byte=c["compress_s_per_byte"])


def _ring_row(table: list[dict], mode: str, compressor: str) -> dict:
    """predict()'s row of ``mode`` over the ring: DDP's backend allreduce, priced as the ring, is
    labelled "ring" or, where plugins declare it, "native"."""
    return next(t for t in table if (t["mode"], t["compressor"]) == (mode, compressor)
                and t["algorithm"] in ("ring", "native"))


def test_benchmark_cells_are_there():
    cells = _measured_cells()
    assert len(cells) >= 30
    assert {c["world_size"] for c in cells} == {2, 4}
    assert {c["link"] for c in cells} >= {"100mbit", "1gbit", "loopback"}


@pytest.mark.parametrize("cell", _measured_cells(), ids=lambda c: c["name"])
def test_map_reproduces_the_measured_cells_predictions(cell):
    """Given this machine's calibration (link, compute, κ, slowdown), each arm of the map is the
    prediction the benchmark recorded next to the measurement, and predict()'s row: one model."""
    scenario = _scenario(cell)
    arm = _ARM_OF[(cell["mode"], cell["width"], cell["compressor"])]
    row = next(r for r in arm_rows(scenario) if r["arm"] == arm)
    assert row["iter_ms"] == pytest.approx(cell["predicted_iter_ms"], rel=1e-6)
    c = cell["calibration"]
    table = predict(cell["params"], cell["world_size"], scenario.link, scenario.compute_s, scenario.update_s, 2,
                    ("none", "fp16", "int8"), c["compress_s_per_byte"], overlap_slowdown=c["overlap_slowdown"])
    assert row["iter_ms"] == pytest.approx(_ring_row(table, cell["mode"], cell["compressor"])["iter_ms"], rel=1e-12)


def test_map_cli_with_a_calibration_file_gives_the_recorded_predictions(tmp_path, capsys):
    cells = [c for c in _measured_cells() if c["name"].startswith("resnet20/p4/100mbit/")]
    assert cells
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(cells[0]["calibration"]))
    assert main(["map", "--params", str(cells[0]["params"]), "--workers", "4", "--calibration", str(cal),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by_arm = {r["arm"]: r["iter_ms"] for r in out["rows"]}
    for cell in cells:
        assert by_arm[_ARM_OF[(cell["mode"], cell["width"], cell["compressor"])]] == \
            pytest.approx(cell["predicted_iter_ms"], rel=1e-6)
    assert out["summary"]["winner"] in ARMS
    assert out["inputs"]["sources"]["compute"] == "calibration"


def test_cluster_arms_equal_predict_rows_and_the_summary_compares_best_arms():
    link = Link.from_bandwidth(25e9, 14e-6)
    model = MODELS["resnet50"]
    s = Scenario(model.params, 64, link, 0.1036, shapes=model.shapes)
    rows = arm_rows(s)
    table = predict(model.params, 64, link, 0.1036, 0.0, 2, ("none", "fp16", "int8"), forward_fraction=1 / 3)
    for row in rows:
        if row["compressor"] == "powersgd":
            continue
        assert row["iter_ms"] == pytest.approx(_ring_row(table, row["mode"], row["compressor"])["iter_ms"], rel=1e-12)
    summary = summarize(rows)
    pipe = min(r["iter_ms"] for r in rows if r["mode"] == "pipe")
    ddp = min(r["iter_ms"] for r in rows if r["mode"] == "ddp")
    assert summary["pipe_over_ddp"] == pytest.approx(ddp / pipe)
    assert summary["winner"] == min(rows, key=lambda r: r["iter_ms"])["arm"]


def test_hierarchical_is_offered_and_taken_only_when_faster():
    link = Link.from_bandwidth(100e9, 14e-6)
    nvlink = Link.from_bandwidth(2.4e12, 3.4e-6)
    model = MODELS["gpt2-xl"]
    flat = {r["arm"]: r for r in arm_rows(Scenario(model.params, 256, link, 0.3, shapes=model.shapes))}
    both = {r["arm"]: r for r in arm_rows(Scenario(model.params, 256, link, 0.3, shapes=model.shapes,
                                                    per_node=8, intra=nvlink))}
    assert all(r["algorithm"] == "ring" for r in flat.values())
    assert any(r["algorithm"] == "hierarchical" for r in both.values())
    for arm in ARMS:
        assert both[arm]["iter_ms"] <= flat[arm]["iter_ms"] + 1e-9


def test_powersgd_bytes_follow_torchs_hook():
    """Per-layer: each tensor as torch's powerSGD_hook decides (its own _should_compress), summed
    over buckets, whatever the bucket boundaries cut."""
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    for name in ("resnet50", "vit-b16"):
        shapes = MODELS[name].shapes
        dense = p_vals = q_vals = flops = 0
        for shape in shapes:
            n = shape[0]
            m = math.prod(shape) // n
            r = min(2, n, m)
            compress, numel, _ = hook._should_compress(n, m, r, 2)
            if compress:
                p_vals += n * r
                q_vals += m * r
                flops += 6 * n * m * r + 4 * n * r * r  # three products and P's QR
            else:
                dense += numel
        nbytes = 4 * sum(math.prod(s) for s in shapes)
        for buckets in ([nbytes], [2**20, 25 * 2**20, nbytes - 2**20 - 25 * 2**20], [nbytes / 7] * 7):
            got = ddp_traffic(shapes, buckets, 2)
            assert len(got) == len(buckets)
            assert sum(b[0] for b in got) == pytest.approx(dense)
            assert sum(b[1] for b in got) == pytest.approx(p_vals)
            assert sum(b[2] for b in got) == pytest.approx(q_vals)
            assert sum(b[3] for b in got) == pytest.approx(flops)
    # DDP fills buckets from the last parameters: ResNet-50's first bucket holds the fc layer.
    fc = ddp_traffic(MODELS["resnet50"].shapes, [4 * (1000 * 2048 + 1000), 4 * 1e9], 2)[0]
    assert fc == pytest.approx((1000, 2 * 1000, 2 * 2048, 6 * 1000 * 2048 * 2 + 4 * 1000 * 4))


def test_powersgd_without_shapes_is_the_stated_approximation():
    s = Scenario(25_000_000, 8, Link.from_bandwidth(10e9, 14e-6), 0.1)
    assert "APPROXIMATION" in s.powersgd_bytes_from
    (dense, p_vals, q_vals, flops), = ddp_traffic(None, [4 * 1_000_000], 2)
    assert (dense, p_vals, q_vals, flops) == (0.0, 2000.0, 2000.0, 6 * 1000 * 1000 * 2 + 4 * 1000 * 4)
    row = next(r for r in arm_rows(s) if r["arm"] == "ddp-powersgd")
    assert row["ratio"] > 100


def test_every_preset_cites_a_source_and_matches_its_published_count():
    for model in MODELS.values():
        assert "http" in model.source or "et al." in model.source, model.name
        assert model.params == pytest.approx(model.published_params, rel=0.02), model.name
    assert MODELS["resnet50"].params == 25_557_032
    for cell in COMPUTE:
        assert cell.model in MODELS and cell.gpu in GPUS
        assert "http" in cell.source and str(int(cell.throughput)) in cell.source
        assert cell.step_ms == pytest.approx(1e3 * cell.batch / cell.throughput)
        assert compute_preset(cell.model, cell.gpu) is cell
    for link in LINKS.values():
        assert link.source and link.latency_source and link.bits_per_second > 0 and link.latency_s > 0


@pytest.mark.parametrize("argv, named", [
    (["--model", "bert-large", "--gpu", "h100", "--link", "25gbe", "--workers", "8"], "'h100'"),
    (["--params", "1000", "--gpu", "a100", "--link", "25gbe", "--workers", "8"], "--gpu"),
    (["--model", "resnet50", "--gpu", "a100", "--compute-ms", "5", "--link", "25gbe", "--workers", "8"], "--gpu"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--workers", "1"], "'1'"),
    (["--params", "1000", "--compute-ms", "5", "--link", "3gbe", "--workers", "8"], "'3gbe'"),
    (["--params", "1000", "--compute-ms", "5", "--bandwidth", "10gbps", "--latency", "5us", "--workers", "8"],
     "'10gbps'"),
    (["--params", "1000", "--compute-ms", "5", "--bandwidth", "10gbit", "--workers", "8"], "--latency"),
    (["--params", "1000", "--compute-ms", "5", "--workers", "8"], "link"),
    (["--params", "1000", "--link", "25gbe", "--workers", "8"], "--compute-ms"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--workers", "8", "--per-node", "3"],
     "per_node=3"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--workers", "8", "--intra", "nvlink-a100"],
     "--per-node"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--workers", "8", "--per-node", "8", "--intra",
      "nvlink-a100"], "--per-node 8"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--workers", "8", "--backward-share", "1.5"],
     "'1.5'"),
    (["--params", "1000", "--compute-ms", "5", "--link", "25gbe", "--bandwidth", "1gbit", "--workers", "8"],
     "--link"),
])
def test_map_cli_errors_name_the_bad_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["map", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_map_cli_table_names_inputs_and_winner(capsys):
    assert main(["map", "--model", "resnet50", "--gpu", "v100", "--link", "10gbe", "--workers", "64"]) == 0
    out = capsys.readouterr().out
    assert "213.3 ms (v100, batch 256" in out
    assert "per-layer P/Q sizes" in out
    for arm in ARMS:
        assert f"\n{arm} " in out
    assert "winner: " in out and "x the best DDP arm" in out


def test_scale_map_doc_table_is_the_maps_own_numbers():
    """docs/scale-map.md's measured-against-map table is results/benchmarks/benchmarks.json and the map, not a copy."""
    cells = {c["name"]: c for c in _measured_cells()}
    rows = [line.split("|")[1:-1] for line in (ROOT / "docs/scale-map.md").read_text().splitlines()
            if line.startswith("| resnet20/")]
    assert {r[0].strip() for r in rows} == set(cells)
    for name, measured, mapped, _ in rows:
        cell = cells[name.strip()]
        arm = _ARM_OF[(cell["mode"], cell["width"], cell["compressor"])]
        row = next(r for r in arm_rows(_scenario(cell)) if r["arm"] == arm)
        assert float(measured) == pytest.approx(cell["median_iter_ms"], abs=0.05)
        assert float(mapped) == pytest.approx(row["iter_ms"], abs=0.05)


def test_documented_heatmaps_exist_and_only_resnet50_claims_a_published_step():
    from pipesgd_lab.report.scale_map import documented_panels

    doc = (ROOT / "docs/scale-map.md").read_text()
    for panel in documented_panels():
        assert (ROOT / "docs/img" / panel.file).is_file(), panel.file
        assert f"img/{panel.file}" in doc
        published = any(c.model == panel.model and c.step_ms == panel.compute_ms for c in COMPUTE)
        assert ("(published)" in panel.compute_label) == published


def test_render_panel_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from pipesgd_lab.report.scale_map import Panel, render_panel

    path = render_panel(Panel("vit-b16", 100.0, "100 ms, a test input", "x.png"), tmp_path)
    assert path == tmp_path / "x.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _measured(tmp_path, **row) -> Path:
    """A step_times.json as `make gpu-check` writes it (pipesgd_lab/gpu_check/checks.py, step_times)."""
    path = tmp_path / "step_times.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.54", "torch": "2.13.0",
                                "date": "2026-11-27T06:00:00+00:00", "rows": [
                                    {"model": "resnet50", "preset": "resnet50", "batch": 256,
                                     "precision": "mixed (AMP fp16)", "step_ms": 100.0, "backward_share": 0.6,
                                     **row}]}))
    return path


def test_the_map_reads_the_step_time_a_gpu_measured(tmp_path, capsys):
    path = _measured(tmp_path)
    assert main(["map", "--model", "resnet50", "--gpu", str(path), "--link", "10gbe", "--workers", "64",
                 "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert main(["map", "--model", "resnet50", "--compute-ms", "100", "--backward-share", "0.6",
                 "--link", "10gbe", "--workers", "64", "--json"]) == 0
    by_hand = json.loads(capsys.readouterr().out)
    assert measured["rows"] == by_hand["rows"], "the measured step and its backward share, as if typed"


@pytest.mark.parametrize("argv, named", [
    (["--model", "bert-large"], "no measured row for model 'bert-large' (measured: ['resnet50'])"),
    (["--model", "resnet50", "--bad"], "resnet50.step_ms must be a finite number >= 0, got -1.0"),
])
def test_a_measured_file_without_the_model_or_with_a_bad_row_is_a_usage_error(tmp_path, capsys, argv, named):
    path = _measured(tmp_path, step_ms=-1.0) if "--bad" in argv else _measured(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["map", *[a for a in argv if a != "--bad"], "--gpu", str(path), "--link", "10gbe", "--workers", "8"])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_gpu_is_a_preset_or_an_existing_file(capsys):
    with pytest.raises(SystemExit):
        main(["map", "--model", "resnet50", "--gpu", "rtx4090", "--link", "10gbe", "--workers", "8"])
    assert "a step_times.json written by make gpu-check, got 'rtx4090'" in capsys.readouterr().err


def test_powersgds_compute_is_priced_at_the_calibrated_rate_per_declared_flop():
    """The hook's matmuls and QR lengthen each bucket's chain by its declared FLOPs times the
    measured seconds per FLOP; with the constant at 0 (a calibration from before it) nothing moves."""
    from pipesgd.registry import registry
    from pipesgd.timing import ddp_buckets, ddp_iteration_time

    assert registry("reduction").facts("powersgd")["step_flops"](100, 50, 2) == 6 * 100 * 50 * 2 + 4 * 100 * 4
    shapes = MODELS["resnet50"].shapes
    params = sum(math.prod(x) for x in shapes)
    base = Scenario(params, 8, Link.from_bandwidth(10e9, 14e-6), 0.2, shapes=shapes)
    priced = replace(base, powersgd_s_per_flop=1e-10)

    def ms(s):
        return next(r for r in arm_rows(s, ["ddp-powersgd"]))["iter_ms"]

    sizes = ddp_buckets(base.nbytes, base.bucket_cap_bytes, min(2**20, base.bucket_cap_bytes))
    values = ddp_traffic(shapes, sizes, 2)
    comms = [sum(comm_time("ring", 4 * v, 8, base.link) for v in b[:3]) + b[3] * 1e-10 for b in values]
    assert ms(priced) == pytest.approx(1e3 * ddp_iteration_time(0.2, sizes, comms, 0.0, 1 - base.backward_share))
    assert ms(priced) > ms(base)
    with pytest.raises(ValueError, match="powersgd_s_per_flop"):
        replace(base, powersgd_s_per_flop=-1.0)


@pytest.mark.timeout(60)
def test_calibrate_times_powersgds_own_compute_per_declared_flop(tmp_path):
    """The constant is the real reduction's time over the FLOPs it declares for the shapes it bound."""
    import torch.distributed as dist

    from pipesgd_lab.bench.calibrate import powersgd_cost
    from pipesgd.reduction.powersgd import step_flops

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shapes = [(64, 32, 3, 3), (64,), (10, 64)]
        per_flop, step_s = powersgd_cost(shapes, repeats=5)
    finally:
        dist.destroy_process_group()
    flops = step_flops(64, 32 * 9, 2) + step_flops(10, 64, 2)  # the bias travels dense: no FLOPs
    assert step_s > 0 and per_flop == pytest.approx(step_s / flops)


def test_map_cli_prices_powersgds_compute_from_the_calibration_or_the_flag(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 0.0,
                               "compress_s_per_byte": {}, "compute_ms": 100.0, "update_ms": 1.0,
                               "powersgd_s_per_flop": 2e-10}))

    def powersgd(*extra):
        assert main(["map", "--model", "resnet50", "--workers", "8", "--calibration", str(cal), "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["inputs"]["powersgd_s_per_flop"], next(r for r in out["rows"] if r["arm"] == "ddp-powersgd")["iter_ms"]

    (k_cal, ms_cal), (k_off, ms_off) = powersgd(), powersgd("--powersgd-s-per-flop", "0")
    assert (k_cal, k_off) == (2e-10, 0.0) and ms_cal > ms_off


def test_the_map_adds_each_arms_barriers_from_the_calibration_or_the_flag(tmp_path, capsys):
    """DDP + PowerSGD (a hook with allreduces of its own) waits at the same barriers as DDP: with
    buffers, forward's broadcast and backward's buckets at width 1, the broadcast alone pipelined."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 0.0,
                               "compress_s_per_byte": {}, "compute_ms": 100.0, "update_ms": 1.0,
                               "barrier_s": 0.003}))

    def rows(*extra):
        assert main(["map", "--model", "resnet50", "--workers", "8", "--calibration", str(cal), "--json",
                     "--arms", "all", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["inputs"], {r["arm"]: r["iter_ms"] for r in out["rows"]}

    (plain_in, plain), (cal_in, priced), (flag_in, flag) = rows("--barrier-ms", "0"), rows("--buffers"), \
        rows("--buffers", "--barrier-ms", "1")
    assert (plain_in["barrier_s"], cal_in["barrier_s"], flag_in["barrier_s"]) == (0.0, 0.003, 0.001)
    assert cal_in["buffers"] and not plain_in["buffers"]
    for arm, ms in priced.items():
        n = barriers_per_step(ALL_ARMS[arm].mode, ALL_ARMS[arm].width, True)
        assert ms == pytest.approx(plain[arm] + 3.0 * n) and flag[arm] == pytest.approx(plain[arm] + n), arm
    assert priced["ddp-powersgd"] - plain["ddp-powersgd"] == pytest.approx(6.0)


def test_the_gpt_recipes_model_is_a_preset_with_its_built_shapes():
    """The map's ``gpt-shakespeare`` preset is the model the recipe builds, tensor for tensor."""
    from pipesgd.models import GPT
    from pipesgd.timing.model import MODEL_PARAMS

    built = [tuple(p.shape) for p in GPT(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128).parameters()]
    assert list(MODELS["gpt-shakespeare"].shapes) == built
    assert MODELS["gpt-shakespeare"].params == MODEL_PARAMS["gpt"] == sum(math.prod(s) for s in built)
