"""``python -m pipesgd_lab.bench.calibrate_cli`` without running it: the α–β fit by hand, and its
arguments validated (the real run on 2 Gloo ranks is tests/lab/test_calibrate.py)."""

from __future__ import annotations

import pytest

from pipesgd_lab.bench.calibrate import CalibrationError, CalibrationSpec, fit_alpha_beta, parse_size
from pipesgd_lab.bench.calibrate_cli import main as calibrate_main


def test_fit_recovers_alpha_and_beta_exactly():
    sizes = [4, 1024, 65536, 1 << 20]
    alpha, beta = 5e-5, 8e-8
    a, b = fit_alpha_beta(sizes, [alpha + n * beta for n in sizes])
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)


def test_fit_takes_alpha_from_latency_bound_sizes_only():
    # β = 1e-9; the 1 MiB point alone fixes the slope, its noise must not leak into α.
    sizes = [4, 1024, 1 << 20]
    seconds = [1e-4, 1.2e-4, 1e-4 + (1 << 20) * 1e-9]
    a, b = fit_alpha_beta(sizes, seconds)
    assert b > 0
    assert min(seconds[:2]) - 1024 * b <= a <= max(seconds[:2])


def test_fit_refuses_a_flat_sweep():
    with pytest.raises(CalibrationError, match="β"):
        fit_alpha_beta([4, 1024, 4096], [1e-4, 1e-4, 0.9e-4])


def test_spec_and_sizes_are_validated():
    assert parse_size("64k") == 65536 and parse_size("4m") == 4 << 20 and parse_size("12") == 12
    with pytest.raises(ValueError, match="bad size"):
        parse_size("4 gigs")
    with pytest.raises(ValueError, match="conf/model"):
        CalibrationSpec(model="nope")
    with pytest.raises(ValueError, match="small message"):
        CalibrationSpec(sizes=(1 << 20, 4 << 20))
    assert CalibrationSpec(model="mlp").dataset == "mnist" and CalibrationSpec().dataset == "cifar10"


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        calibrate_main(["--model", "nope"])
    assert "conf/model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate_main(["stray"])
    assert "hydra.run.dir" in capsys.readouterr().err
