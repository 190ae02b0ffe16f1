"""The outer-optimizer sweep's reader: each schedule's best setting, the default's excess over it,
and sync's loss as the reference, from the runs' summary.json files."""

import json

from pipesgd.outer import settings
from pipesgd_lab.bench import outer_sweep


def _summary(h, lr, momentum, loss, world=2):
    outer = {"_target_": "torch.optim.SGD", "lr": lr, "momentum": momentum, "nesterov": bool(momentum)}
    return {"mode": "sync", "compressor": "int8", "world_size": world, "steps": 559, "test_loss": loss,
            **({"sync_every": h, "fragments": 1, "sync_delay": 0, "outer_rule": "none"} if h > 1 else {}),
            "config": {"outer_optimizer": outer, "trainer": {}, "dist": {"nproc": world}, "seed": 0}}


def _write(root, name, summary):
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps(summary))


def test_best_default_and_sync(tmp_path):
    d = settings(10, 2)
    _write(tmp_path, "sync", _summary(1, None, None, 2.0))
    _write(tmp_path, "a", _summary(10, d.lr, d.momentum, 2.02))
    _write(tmp_path, "b", _summary(10, 1.0, 0.0, 2.10))
    _write(tmp_path, "c", _summary(10, 0.3, 0.9, 2.01))
    [row] = outer_sweep.study(outer_sweep.collect([tmp_path]))["schedules"]
    assert row["best"] == {"lr": 0.3, "momentum": 0.9, "nesterov": True} and row["sync_loss"] == 2.0
    assert abs(row["default_over_best"] - (2.02 / 2.01 - 1)) < 1e-12
    assert "| 10 | 2 × 1 |" in outer_sweep.table(outer_sweep.study(outer_sweep.collect([tmp_path])))


def test_a_default_never_run_is_none_not_guessed(tmp_path):
    _write(tmp_path, "b", _summary(10, 1.0, 0.0, 2.10) | {"world_size": 4})
    [row] = outer_sweep.study(outer_sweep.collect([tmp_path]))["schedules"]
    assert row["replicas"] == 4 and row["default_loss"] is None and row["sync_loss"] is None
