"""The study script turns run summaries into the table the docs quote: labels, mean ± half-range
over seeds, gap to sync, time to a target accuracy."""

import json
from pathlib import Path

import pytest

from pipesgd_lab.study import label, load, main, markdown, rows


def summary(mode, seed, acc, staleness="none", compressor="none", ef=False, evals=()):
    return {"mode": mode, "width": 1 if mode == "sync" else 2, "staleness": staleness, "compressor": compressor,
            "test_accuracy": acc, "epochs": 2, "bytes_per_step": 100, "compression_ratio": 1.0,
            "median_iter_ms": 5.0, "wall_seconds": 10.0,
            "evals": [{"epoch": e, "test_accuracy": a, "elapsed_s": t} for e, a, t in evals],
            "config": {"seed": seed, "data": {"_target_": "pipesgd.data.MNIST"},
                       "model": {"_target_": "pipesgd.models.mlp"},
                       "trainer": {"staleness": staleness}, "compressor": {"error_feedback": ef}}}


@pytest.fixture
def sweep(tmp_path):
    runs = [summary("sync", 0, 0.97, evals=[(1, 0.95, 4.0), (2, 0.97, 8.0)]),
            summary("sync", 1, 0.98, evals=[(1, 0.96, 4.0), (2, 0.98, 8.0)]),
            summary("pipe", 0, 0.96, "dga", evals=[(1, 0.94, 4.0), (2, 0.96, 9.0)]),
            summary("pipe", 1, 0.95, "dga", evals=[(1, 0.90, 4.0), (2, 0.95, 9.0)]),
            summary("pipe", 0, 0.95, compressor="int8", ef=True, evals=[(1, 0.9, 5.0), (2, 0.95, 10.0)])]
    for i, s in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(s))
    return tmp_path


def test_labels_name_the_rule_and_the_error_feedback():
    assert label(summary("sync", 0, 0.9)) == "sync"
    assert label(summary("pipe", 0, 0.9, "predict")) == "pipe+predict"
    assert label(summary("pipe", 0, 0.9, compressor="int8", ef=True)) == "pipe+int8-ef"
    assert label(summary("pipe", 0, 0.9, compressor="topk", ef=True)) == "pipe+topk"
    assert label(summary("pipe", 0, 0.9, compressor="topk", ef=False)) == "pipe+topk-noef"


def test_rows_average_over_seeds_and_measure_the_gap_to_sync(sweep):
    table = {r["variant"]: r for r in rows(load(sweep), target=0.96)}
    assert list(table) == ["sync", "pipe+dga", "pipe+int8-ef"]
    assert table["sync"]["acc_mean"] == pytest.approx(0.975) and table["sync"]["acc_spread"] == pytest.approx(0.005)
    assert table["pipe+dga"]["gap_pp"] == pytest.approx(-2.0)
    assert table["sync"]["time_to_target_s"] == pytest.approx((8.0 + 4.0) / 2)
    assert table["pipe+dga"]["time_to_target_s"] is None, "seed 1 never reached 96 %"
    text = markdown(list(table.values()), 0.96)
    assert "| MNIST | mlp | pipe+dga | 2 | 2 | 95.50 ± 0.50 | 96.00 / 95.00 | -2.00 |" in text


def test_cli_writes_table_and_plot(sweep, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main([str(sweep), "--plot", str(tmp_path / "acc.png"), "--json", str(tmp_path / "t.json")]) == 0
    assert "pipe+int8-ef" in capsys.readouterr().out
    assert (tmp_path / "acc.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "t.json").read_text())) == 3


VARIANTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "variant").glob("*.yaml"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_composes_after_an_experiment_and_validates(variant):
    """The study's multirun relies on each variant overriding the experiment it follows."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from pipesgd.config import validate

    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=resnet_cifar", f"+variant={variant}"])
    validate(cfg)
    compressor = instantiate(cfg.compressor)
    staleness = instantiate(cfg.staleness)
    assert cfg.trainer.mode == ("sync" if variant == "sync" else "pipe")
    expected = {"pipe_int8": "int8", "pipe_int8_ef": "int8", "pipe_topk": "topk", "pipe_powersgd": "powersgd"}
    assert compressor.name == expected.get(variant, "none")
    assert staleness.name == {"pipe_dc": "dc", "pipe_predict": "predict", "pipe_dga": "dga",
                              "pipe_lookahead": "lookahead"}.get(variant, "none")
    ef = compressor.memory is not None if hasattr(compressor, "memory") else compressor.error_feedback
    assert ef == (variant in ("pipe_int8_ef", "pipe_topk", "pipe_powersgd"))
