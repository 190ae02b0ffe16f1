"""The timing model against hand-computed values, its invariants, validation, and the CLI."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipesgd.timing import (
    MODEL_PARAMS,
    Link,
    TimingModel,
    allreduce_time,
    bucketed_backward,
    compression_ratio,
    ddp_buckets,
    ddp_iteration_time,
    comm_time,
    iteration_time,
    load_calibration,
    load_timing_model,
    parse_bandwidth,
    parse_latency,
    pipeline_schedule,
    predict,
    predict_iter_ms,
    total_time,
)
from pipesgd.timing.__main__ import main
from pipesgd.timing.model import barriers_per_step

ROOT = Path(__file__).resolve().parents[2]
M = 1_000_000.0  # bytes
A, B, G, K = 1e-4, 1e-8, 1e-9, 2e-9  # α s/msg, β s/B (800 Mbit/s), γ s/B, κ s/B


# --- collectives, written out --------------------------------------------------------------------


def test_ring_by_hand():
    # p=4: 2(p-1) = 6 steps of α + M/p·β = 1e-4 + 250_000·1e-8 = 2.6e-3 -> 15.6e-3,
    # plus (p-1)/p·M·γ = 0.75·1e6·1e-9 = 0.75e-3.
    assert allreduce_time("ring", M, 4, A, B, G) == pytest.approx(15.6e-3 + 0.75e-3, rel=1e-12)
    # ratio 4: 6·(1e-4 + 62_500·1e-8) = 6·7.25e-4 = 4.35e-3; γ term unchanged (sums in fp32);
    # κ term (1 + 3/8)·M·κ = 1.375·1e6·2e-9 = 2.75e-3.
    t = allreduce_time("ring", M, 4, A, B, G, ratio=4.0, compress_s_per_byte=K)
    assert t == pytest.approx(4.35e-3 + 0.75e-3 + 2.75e-3, rel=1e-12)


def test_tree_by_hand():
    # p=5: L = ceil(log2 5) = 3 rounds each way: 6·(α + M·β) = 6·(1e-4 + 1e-2) = 60.6e-3,
    # plus L·M·γ = 3e-3.
    assert allreduce_time("tree", M, 5, A, B, G) == pytest.approx(60.6e-3 + 3e-3, rel=1e-12)
    # p=4: L = 2; ratio 2: 4·(1e-4 + 5e-3) = 20.4e-3; + 2e-3 γ; + (L+1)·M·κ = 3·2e-3 = 6e-3.
    t = allreduce_time("tree", M, 4, A, B, G, ratio=2.0, compress_s_per_byte=K)
    assert t == pytest.approx(20.4e-3 + 2e-3 + 6e-3, rel=1e-12)


def test_ps_by_hand():
    # p=3 workers, one server link: pushes 3·(α + M·β) = 30.3e-3, server sums (p-1)·M·γ = 2e-3,
    # pulls of fp32 weights 3·(α + M·β) = 30.3e-3.
    assert allreduce_time("ps", M, 3, A, B, G) == pytest.approx(62.6e-3, rel=1e-12)
    # ratio 2 shrinks only the pushes: 3·(1e-4 + 5e-3) = 15.3e-3; κ: (p+1)/2·M·κ = 2·2e-3 = 4e-3.
    t = allreduce_time("ps", M, 3, A, B, G, ratio=2.0, compress_s_per_byte=K)
    assert t == pytest.approx(15.3e-3 + 2e-3 + 30.3e-3 + 4e-3, rel=1e-12)


def test_server_on_a_worker_rank_saves_one_push_and_pull_only():
    # pipesgd.engine.ps puts the server on rank 0, which also trains: p=2 means ONE remote push and pull
    # (2·(α + M·β) = 20.2e-3) but still one server-side add (M·γ = 1e-3). The bug this pins: the
    # p-1 workers were passed as p, and p=1 took the "no communication" shortcut (0 s).
    assert allreduce_time("ps", M, 2, A, B, G, server_on_worker=True) == pytest.approx(21.2e-3, rel=1e-12)
    # p=3, ratio 2: pushes 2·(1e-4 + 5e-3), pulls 2·(1e-4 + 1e-2), 2·M·γ, κ: (2+1)/2·M·κ = 3e-3.
    t = allreduce_time("ps", M, 3, A, B, G, ratio=2.0, compress_s_per_byte=K, server_on_worker=True)
    assert t == pytest.approx(10.2e-3 + 20.2e-3 + 2e-3 + 3e-3, rel=1e-12)
    assert allreduce_time("ps", M, 1, A, B, G, server_on_worker=True) == 0.0
    # The prediction a ps_sync run logs uses it: compute + that exchange.
    link = Link(A, B, G)
    ms = predict_iter_ms("ps_sync", "ps", M, 2, link, compute_s=0.1, server_on_worker=True)
    assert ms == pytest.approx(1e3 * (0.1 + 21.2e-3), rel=1e-9)


def test_kappa_ignored_without_compression_and_ring_beats_tree_at_scale():
    assert allreduce_time("ring", M, 4, A, B, G, ratio=1.0, compress_s_per_byte=1.0) == \
        allreduce_time("ring", M, 4, A, B, G)
    # bandwidth term: ring 2(p-1)/p·M·β -> 2Mβ, tree 2·log2(p)·M·β grows with p.
    assert allreduce_time("ring", M, 64, 0, B) < allreduce_time("tree", M, 64, 0, B)


def test_hierarchical_by_hand():
    intra, inter = Link(1e-6, 1e-10), Link(A, B, G)
    # 2 nodes x 4 ranks: intra tree L=2 rounds each way, 4·(1e-6 + 1e-4) = 404e-6; ring of 2
    # leaders: 2·(α + M/2·β) + 1/2·M·γ = 2·(1e-4 + 5e-3) + 0.5e-3 = 10.7e-3.
    t = comm_time("hierarchical", M, 8, inter, per_node=4, intra=intra)
    assert t == pytest.approx(404e-6 + 10.7e-3, rel=1e-12)
    assert comm_time("hierarchical", M, 4, inter, per_node=1, intra=intra) == allreduce_time("ring", M, 4, A, B, G)
    with pytest.raises(ValueError, match="per_node=3"):
        comm_time("hierarchical", M, 8, inter, per_node=3)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "ps"])
def test_one_worker_costs_nothing(algorithm):
    assert allreduce_time(algorithm, M, 1, A, B, G, ratio=4.0, compress_s_per_byte=K) == 0.0


@pytest.mark.parametrize("call, needle", [
    (lambda: allreduce_time("butterfly", M, 2, A, B), "'butterfly'"),
    (lambda: allreduce_time("ring", M, 0, A, B), "p must be"),
    (lambda: allreduce_time("ring", M, 2.5, A, B), "p must be"),
    (lambda: allreduce_time("ring", -1.0, 2, A, B), "nbytes"),
    (lambda: allreduce_time("ring", M, 2, -A, B), "alpha"),
    (lambda: allreduce_time("ring", M, 2, A, -B), "beta"),
    (lambda: allreduce_time("ring", M, 2, A, B, -G), "gamma"),
    (lambda: allreduce_time("ring", M, 2, A, B, ratio=0.0), "ratio"),
    (lambda: allreduce_time("ring", M, 2, A, float("nan")), "beta"),
    (lambda: iteration_time("warp", 1.0, 1.0), "'warp'"),
    (lambda: iteration_time("pipe", 1.0, 1.0, width=0), "width"),
    (lambda: iteration_time("ps_async", 1.0, 1.0), "needs p"),
    (lambda: iteration_time("ddp", -1.0, 1.0), "compute_s"),
    (lambda: compression_ratio("zip", 10), "'zip'"),
    (lambda: Link(-1.0, B), "Link.alpha"),
    (lambda: Link.from_bandwidth(0, 0), "bits_per_second"),
    (lambda: predict_iter_ms("ps_sync", "ring", M, 2, Link(A, B), 0.1), "needs algorithm"),
])
def test_validation_names_the_argument(call, needle):
    with pytest.raises(ValueError) as e:
        call()
    assert needle in str(e.value)


def test_unknown_algorithm_lists_allowed():
    with pytest.raises(ValueError) as e:
        allreduce_time("butterfly", M, 2, A, B)
    assert "'butterfly'" in str(e.value) and "['ring', 'native', 'tree', 'auto', 'hierarchical', 'ps']" in str(e.value)


# --- units ---------------------------------------------------------------------------------------


def test_parse_units():
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("10gbit") == 1e10
    assert parse_bandwidth("1.5Gbit") == 1.5e9
    assert parse_bandwidth("1kibit") == 1024
    assert parse_latency("50us") == pytest.approx(50e-6, rel=1e-15)
    assert parse_latency("0.5ms") == 0.5e-3
    assert parse_latency("2s") == 2.0
    assert parse_latency("0") == 0.0
    link = Link.from_bandwidth(1e8, 50e-6)
    assert link.beta == 8e-8 and link.alpha == 50e-6 and link.bits_per_second == pytest.approx(1e8)
    assert Link.parse("100mbit", "50us") == link


@pytest.mark.parametrize("text", ["fast", "100", "100mbps", "-5mbit", "0mbit", "1 gigabit", ""])
def test_bad_bandwidth_names_the_string(text):
    with pytest.raises(ValueError) as e:
        parse_bandwidth(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text", ["soon", "50", "5 min", "-1ms", "1e999s"])
def test_bad_latency_names_the_string(text):
    with pytest.raises(ValueError) as e:
        parse_latency(text)
    assert repr(text) in str(e.value)


# --- compression ratios --------------------------------------------------------------------------


def test_compression_ratio_arithmetic():
    compress = pytest.importorskip("pipesgd.compress")
    per_chunk = compress.get_compressor("int8", block_size=0)
    assert compression_ratio("none", 1000) == 1.0
    assert compression_ratio("fp16", 1000) == compression_ratio("bf16", 1000) == 2.0
    # int8, one scale per chunk: 4·1000 B raw / (1000 B of values + 2 chunks·4 B scales).
    assert compression_ratio(per_chunk, 1000, chunks=2) == 4000 / 1008
    # blocks of 2048 (int8's default) in 2 chunks of 5000 values: ceil(5000/2048) = 3 scales each, 6 in all.
    assert compression_ratio("int8", 10_000, 2) == 40_000 / (10_000 + 24)
    # 3 values in 4 chunks: one chunk is empty and carries no scale.
    assert compression_ratio(per_chunk, 3, 4) == 12 / (3 + 12)
    assert compression_ratio("int8", 0, 4) == 1.0


def test_compression_ratio_matches_the_real_compressors():
    compress = pytest.importorskip("pipesgd.compress")
    torch = pytest.importorskip("torch")
    for name in ("none", "fp16", "bf16", "int8"):
        comp = compress.get_compressor(name)
        for numel in (1, 2047, 5000):
            payload, _ = comp.compress(torch.randn(numel))
            assert compression_ratio(name, numel, 1) == pytest.approx(
                4 * numel / payload.nbytes, rel=1e-12), (name, numel)


def test_model_table_matches_pipesgd_models():
    models = pytest.importorskip("pipesgd.models")
    built = {"resnet20": models.resnet20(), "resnet32": models.resnet32(), "resnet56": models.resnet56(),
             "resnet18": models.resnet18(), "mlp": models.MLP(), "cnn": models.SmallCNN(), "gpt": models.GPT()}
    assert {k: sum(p.numel() for p in m.parameters()) for k, m in built.items()} == MODEL_PARAMS


# --- iteration time per mode ---------------------------------------------------------------------


def test_iteration_time_by_hand():
    c, x, u = 0.172, 0.090, 0.002
    assert iteration_time("sync", c, x, u) == pytest.approx(0.264)
    assert iteration_time("pipe", c, x, u, width=1) == iteration_time("sync", c, x, u)
    assert iteration_time("pipe", c, x, u, width=2) == pytest.approx(0.174)       # max(c + u, x)
    assert iteration_time("pipe", 0.05, x, u, width=4) == pytest.approx(0.090)   # comm-bound
    # ddp: forward c/3 + max(backward 2c/3, x) + u.
    assert iteration_time("ddp", 0.3, 0.25, 0.01) == pytest.approx(0.1 + 0.25 + 0.01)
    assert iteration_time("ps_sync", c, x, u) == pytest.approx(0.264)
    # ps_async: max(c + x/p + u, x + p·u) = max(0.172 + 0.045 + 0.002, 0.090 + 0.004).
    assert iteration_time("ps_async", c, x, u, p=2) == pytest.approx(0.219)
    assert iteration_time("ps_async", 0.01, 1.0, 0.0, p=4) == pytest.approx(1.0)  # server-bound


def test_overlap_slowdown_by_hand():
    # compute 100 ms beside 60 ms of comm, 2x slower meanwhile: 60 ms buys 30 ms of work, the
    # other 70 ms run at full speed -> 130 ms; + 2 ms update.
    assert iteration_time("pipe", 0.1, 0.06, 0.002, overlap_slowdown=2.0) == pytest.approx(0.132)
    # comm 300 ms outlasts the stretched compute (200 ms): comm-bound.
    assert iteration_time("pipe", 0.1, 0.3, 0.0, overlap_slowdown=2.0) == pytest.approx(0.3)


def test_local_mode_is_compute_plus_update():
    """The trainer's compute-only baseline: no communication whatever the link says."""
    assert iteration_time("local", 0.1, 5.0, 0.01) == pytest.approx(0.11)
    assert predict_iter_ms("local", "ring", M, 4, Link(1.0, 1.0), 0.1, 0.01) == pytest.approx(110.0)


@pytest.mark.parametrize("c, x, u", [(0.17, 0.09, 0.002), (0.05, 0.09, 0.002), (0.1, 0.1, 0.0), (0.1, 0.0, 0.01)])
def test_width_two_reaches_the_bound_and_more_width_adds_nothing(c, x, u):
    t = 50
    assert pipeline_schedule(t, c, x, u, width=1) == pytest.approx(t * (c + x + u))
    assert total_time("sync", t, c, x, u) == pytest.approx(t * (c + x + u))
    closed = total_time("pipe", t, c, x, u, width=2)
    assert closed == pytest.approx((t - 1) * max(c + u, x) + c + x + u)
    for k in (2, 3, 5):
        exact = pipeline_schedule(t, c, x, u, width=k)
        # The closed form is exact when comm-bound. Otherwise the engine is a little faster: the
        # K−1 updates deferred by the fill run while the last reduction is in flight, so up to
        # min(x, K·u) is hidden. The steady state is the same for every K >= 2.
        assert closed - min(x, k * u) - 1e-12 <= exact <= closed + 1e-12


def test_ddp_buckets_and_overlap_by_hand():
    mib = 2**20
    assert ddp_buckets(60 * mib) == [1 * mib, 25 * mib, 25 * mib, 9 * mib]
    assert ddp_buckets(0.5 * mib) == [0.5 * mib]
    # two equal buckets over a 100 ms backward: the first is ready at 50 ms and takes 80 ms
    # (done 130); the second is ready at 100 and waits for the channel: 130 + 80 = 210.
    assert bucketed_backward(0.1, [1, 1], [0.08, 0.08]) == pytest.approx((0.1, 0.21))
    assert ddp_iteration_time(0.15, [1, 1], [0.08, 0.08], 0.002) == pytest.approx(0.05 + 0.21 + 0.002)
    # with 2x slowdown while the first bucket flies, the second 50 ms of backward take 80 ms
    # for 40 ms of work, then 10 ms more: backward ends at 140, channel free at 130 -> 220.
    assert bucketed_backward(0.1, [1, 1], [0.08, 0.08], 2.0) == pytest.approx((0.14, 0.22))
    # one bucket: nothing overlaps.
    assert bucketed_backward(0.1, [5], [0.03]) == pytest.approx((0.1, 0.13))


# --- predict -------------------------------------------------------------------------------------


def test_predict_rows():
    link = Link.from_bandwidth(1e8, 50e-6)
    rows = predict(MODEL_PARAMS["resnet20"], 2, link, 0.172, 0.002, width=2, iterations=10)
    keys = {"mode", "algorithm", "compressor", "comm_ms", "iter_ms", "speedup_vs_sync", "total_s"}
    assert all(keys <= set(r) for r in rows)
    index = {(r["mode"], r["algorithm"], r["compressor"]): r for r in rows}
    assert index["sync", "ring", "none"]["speedup_vs_sync"] == 1.0
    # ddp runs the backend's allreduce (its row's fixed_comm), with DDP's own hooks only
    assert ("ddp", "native", "int8") not in index and ("ddp", "native", "fp16") in index
    assert {r["mode"] for r in rows} == {"sync", "pipe", "ddp", "ps_sync", "ps_async", "live", "torchft_diloco"}
    # priced as width 2 over the ring it runs on torchft's group (int8 too); the quorum round-trip is not
    assert ("live", "ring", "none") in index and ("live", "ring", "int8") in index
    assert ("live", "tree", "none") in index and ("live", "tree", "int8") in index  # the tree runs there too
    pipe = index["pipe", "ring", "none"]
    assert pipe["iter_ms"] == pytest.approx(174.0)
    assert pipe["iter_ms"] == predict_iter_ms("pipe", "ring", 4 * MODEL_PARAMS["resnet20"], 2, link, 0.172,
                                              0.002, 2)
    assert index["pipe", "ring", "int8"]["ratio"] == compression_ratio("int8", MODEL_PARAMS["resnet20"], 2)
    hier = predict(1000, 4, link, 0.1, per_node=2)
    assert any(r["algorithm"] == "hierarchical" for r in hier)
    assert not any(r["mode"] == "live" and r["algorithm"] == "hierarchical" for r in hier)  # not among its comms


def test_timing_model_from_config_and_calibration(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    from hydra.utils import instantiate

    cfg = omegaconf.OmegaConf.load(ROOT / "conf/timing/default.yaml")
    model = instantiate(cfg)
    assert isinstance(model, TimingModel) and model.link == Link.parse("10gbit", "50us")
    assert model == load_timing_model()
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 0,
                               "compress_s_per_byte": {"int8": 1e-9}, "compute_ms": 172, "update_ms": 2}))
    model = load_timing_model(calibration=str(cal))
    assert model.link == Link(1e-4, 8e-8, 0.0)
    ms = model.iter_ms("sync", "ring", M, 2, 0.1, 0.0, 1, 4.0, "int8")
    # 2·(1e-4 + 1e6/8·8e-8) = 20.2e-3; κ (1 + 1/4)·1e6·1e-9 = 1.25e-3; + 100 ms compute.
    assert ms == pytest.approx(121.45, rel=1e-12)


def test_load_calibration_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_calibration(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 8e-8}))
    with pytest.raises(ValueError) as e:
        load_calibration(bad)
    assert "bad.json" in str(e.value) and "gamma_s_per_byte" in str(e.value) and "compute_ms" in str(e.value)
    bad.write_text(json.dumps({"alpha_s": -1, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 0,
                               "compress_s_per_byte": {}, "compute_ms": 1, "update_ms": 0}))
    with pytest.raises(ValueError, match="alpha_s"):
        load_calibration(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(bad)


def test_model_module_is_pure_arithmetic():
    for name in ("model.py", "units.py", "calibration.py"):
        tree = ast.parse((ROOT / "pipesgd/timing" / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert not imported & {"torch", "numpy", "omegaconf", "hydra"}, (name, imported)


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_json_equals_the_formulas_exactly():
    """α = γ = 0, no compression: comm_ms is 2(p−1)·M/p·β for the ring, 2⌈log2 p⌉·M·β for the tree."""
    out = subprocess.run([sys.executable, "-m", "pipesgd.timing", "predict", "--params", "272474", "--workers",
                          "3", "--bandwidth", "100mbit", "--latency", "0", "--compute-ms", "172", "--update-ms",
                          "2", "--compressor", "none", "--json"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    index = {(r["mode"], r["algorithm"]): r for r in rows}
    m, p, beta = 4 * 272474, 3, 8 / 1e8
    assert index["sync", "ring"]["comm_ms"] == 2 * (p - 1) * (m / p * beta) * 1e3
    assert index["sync", "tree"]["comm_ms"] == 2 * 2 * (m * beta) * 1e3
    assert index["sync", "ring"]["iter_ms"] == pytest.approx(172 + 2 + index["sync", "ring"]["comm_ms"])
    assert index["pipe", "ring"]["iter_ms"] == pytest.approx(max(174, index["sync", "ring"]["comm_ms"]))


def test_cli_table_and_calibration(capsys, tmp_path):
    assert main(["predict", "--model", "resnet20", "--workers", "2", "--bandwidth", "100mbit", "--latency",
                 "50us", "--compute-ms", "172", "--update-ms", "2", "--iterations", "100"]) == 0
    out = capsys.readouterr().out
    assert "269,722 params" in out and "speedup_vs_sync" in out and "total_s" in out
    assert len([line for line in out.splitlines() if line.startswith("pipe ")]) == 8
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 0, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 0,
                               "compress_s_per_byte": {"int8": 0}, "compute_ms": 100, "update_ms": 0}))
    assert main(["predict", "--params", "1000", "--workers", "2", "--calibration", str(cal), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    sync = next(r for r in rows if (r["mode"], r["algorithm"], r["compressor"]) == ("sync", "ring", "none"))
    assert sync["comm_ms"] == pytest.approx(4000 * 8e-8 * 1e3) and sync["iter_ms"] == pytest.approx(100.32)


@pytest.mark.parametrize("argv, needle", [
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--bandwidth", "100mbps"], "bps"),
    (["--latency", "50"], "--latency"),
    (["--workers", "0"], "--workers"),
    (["--compressor", "zip"], "--compressor"),
    (["--width", "0"], "--width"),
    (["--per-node", "3"], "--per-node"),
    (["--calibration", "/nonexistent/cal.json"], "--calibration"),
])
def test_cli_bad_flags_exit_2_naming_the_flag(capsys, argv, needle):
    base = {"--workers": "4", "--compute-ms": "100", "--params": "1000"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as e:
        main(["predict", *[x for kv in base.items() for x in kv]])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_needs_compute_and_a_size(capsys):
    with pytest.raises(SystemExit) as e:
        main(["predict", "--params", "10", "--workers", "2"])
    assert e.value.code == 2 and "--compute-ms" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["predict", "--workers", "2", "--compute-ms", "1"])
    assert e.value.code == 2 and "--params" in capsys.readouterr().err


def test_bad_calibration_key_is_named(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 0}))
    with pytest.raises(SystemExit) as e:
        main(["predict", "--params", "10", "--workers", "2", "--calibration", str(cal)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "beta_s_per_byte" in err and "cal.json" in err


# --- barriers: what a blocking collective costs a step beyond its bytes ----------------------------


@pytest.mark.parametrize("mode,width,buffers,expected", [
    ("local", 1, True, 0), ("ps_async", 1, True, 0),
    ("sync", 2, False, 1), ("sync", 2, True, 1),        # one blocking sequence a step, buffers in it
    ("pipe", 1, True, 1), ("pipe", 2, False, 0), ("pipe", 2, True, 1), ("pipe", 4, True, 1),
    ("ddp", 1, False, 1), ("ddp", 1, True, 2),          # forward's broadcast_buffers + backward's buckets
    ("ddp", 2, False, 0), ("ddp", 2, True, 1),          # the pipelined hook: only the buffers' broadcast
])
def test_barriers_per_step_by_what_each_mode_waits_for(mode, width, buffers, expected):
    assert barriers_per_step(mode, width, buffers) == expected


def test_each_barrier_adds_barrier_s_to_the_step_and_one_worker_waits_for_nobody():
    link = Link(A, B)
    args = ("ring", 4 * M, 4, link, 0.1, 0.01)
    for mode, width in (("sync", 1), ("pipe", 2), ("ddp", 1), ("ddp", 2), ("local", 1)):
        plain = predict_iter_ms(mode, *args, width=width)
        for buffers in (False, True):
            got = predict_iter_ms(mode, *args, width=width, barrier_s=0.007, buffers=buffers)
            assert got == pytest.approx(plain + 7.0 * barriers_per_step(mode, width, buffers)), (mode, width)
    alone = ("ring", 4 * M, 1, link, 0.1, 0.01)
    assert predict_iter_ms("sync", *alone, width=1, barrier_s=0.5) == predict_iter_ms("sync", *alone, width=1)
    with pytest.raises(ValueError, match="barrier_s"):
        predict_iter_ms("sync", *args, width=1, barrier_s=-1e-3)
    rows = predict(1_000_000, 4, link, 0.1, 0.01, compressors=["none"], barrier_s=0.007, buffers=True,
                   iterations=10)
    plain = {(r["mode"], r["width"], r["algorithm"]): r for r in predict(1_000_000, 4, link, 0.1, 0.01,
                                                                          compressors=["none"], iterations=10)}
    for r in rows:
        n = barriers_per_step(r["mode"], r["width"], True)
        before = plain[(r["mode"], r["width"], r["algorithm"])]
        assert r["iter_ms"] == pytest.approx(before["iter_ms"] + 7.0 * n)
        assert r["total_s"] == pytest.approx(before["total_s"] + 10 * 0.007 * n)


def test_a_calibrations_barrier_reaches_the_runs_prediction(tmp_path):
    cal = {"alpha_s": A, "beta_s_per_byte": B, "gamma_s_per_byte": G, "compress_s_per_byte": {},
           "compute_ms": 100.0, "update_ms": 1.0}
    (tmp_path / "old.json").write_text(json.dumps(cal))
    (tmp_path / "new.json").write_text(json.dumps(cal | {"barrier_s": 0.004}))
    (tmp_path / "bad.json").write_text(json.dumps(cal | {"barrier_s": -0.004}))
    assert load_timing_model(calibration=tmp_path / "old.json").barrier_s == 0.0  # from before it: not modelled
    model = load_timing_model(calibration=tmp_path / "new.json")
    assert model.barrier_s == 0.004
    assert model.iter_ms("ddp", "native", 4 * M, 2, 0.1, width=1, buffers=True) == pytest.approx(
        load_timing_model(calibration=tmp_path / "old.json").iter_ms("ddp", "native", 4 * M, 2, 0.1, width=1) + 8.0)
    with pytest.raises(ValueError, match="bad.json: barrier_s must be a finite number >= 0, got -0.004"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="barrier_s must be a finite number >= 0"):
        TimingModel(Link(A, B), barrier_s=float("nan"))


def test_a_period_h_round_is_one_iteration_of_the_same_schedule():
    """trainer.sync_every=H: one exchange per round of H steps; per step, width 1 pays comm/H on
    top of compute, width 2 hides it behind the round's compute until comm exceeds H·compute."""
    link = Link.from_bandwidth(parse_bandwidth("5mbit"), 0.0)
    nbytes, compute = 4.96e6, 0.5  # the GPT's gradient, 0.5 s of compute per step
    comm_ms = predict_iter_ms("sync", "ring", nbytes, 2, link, 0.0)  # width 1, nothing to overlap: the exchange
    for h in (1, 4, 32):
        blocking = predict_iter_ms("sync", "ring", nbytes, 2, link, compute, sync_every=h)
        assert blocking == pytest.approx(1e3 * compute + comm_ms / h)
        pipelined = predict_iter_ms("pipe", "ring", nbytes, 2, link, compute, width=2, sync_every=h)
        assert pipelined == pytest.approx(max(1e3 * compute, comm_ms / h))
