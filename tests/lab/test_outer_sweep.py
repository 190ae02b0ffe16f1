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
    assert "| 559 | 10 | 2 × 1 |" in outer_sweep.table(outer_sweep.study(outer_sweep.collect([tmp_path])))


def test_a_default_never_run_is_none_not_guessed(tmp_path):
    _write(tmp_path, "b", _summary(10, 1.0, 0.0, 2.10) | {"world_size": 4})
    [row] = outer_sweep.study(outer_sweep.collect([tmp_path]))["schedules"]
    assert row["replicas"] == 4 and row["default_loss"] is None and row["sync_loss"] is None


def test_a_run_of_the_auto_default_is_keyed_by_the_step_it_ran_and_a_rule_names_its_arm(tmp_path):
    d = settings(10, 2)
    auto = _summary(10, None, None, 2.03) | {"outer_step": {"optimizer": "SGD", "lr": d.lr, "momentum": d.momentum,
                                                             "nesterov": d.nesterov}}
    _write(tmp_path, "auto", auto)
    _write(tmp_path, "eager", _summary(10, 1.0, 0.0, 2.2) | {"mode": "pipe", "outer_rule": "eager"})
    record = outer_sweep.study(outer_sweep.collect([tmp_path]))
    blocking = next(r for r in record["schedules"] if r["mode"] == "sync")
    assert blocking["default_loss"] == 2.03 and blocking["best"]["lr"] == d.lr
    assert "| 10 | 2 × 1 | in flight int8 eager | 1.0 | 0.0 | 2.2000" in outer_sweep.table(record)


def test_a_landing_share_left_to_auto_is_keyed_by_the_share_that_ran(tmp_path):
    late = {"mode": "pipe", "sync_delay": 1, "fragments": 5, "world_size": 8}
    cfg = _summary(10, 0.7, 0.9, 2.13)["config"]
    _write(tmp_path, "auto", _summary(10, 0.7, 0.9, 2.13) | late | {
        "landing_alpha": 0.125, "config": cfg | {"trainer": {"landing_alpha": "auto"}}})
    [row] = outer_sweep.collect([tmp_path])
    assert row["landing_alpha"] == 0.125
    assert "F=5 τ=1 α=0.125 |" in outer_sweep.table(outer_sweep.study([row]))


def test_vs_sync_pairs_the_seeds_both_ran_and_names_them_where_not_all(tmp_path):
    # sync ran seed 0 only; the arm ran seeds 0 and 1: its loss over sync's is seed 0's alone
    # (a mean over both seeds against seed 0's sync would mix the seeds' spread into the gap)
    _write(tmp_path, "sync0", _summary(1, None, None, 2.0))
    _write(tmp_path, "a0", _summary(10, 0.7, 0.9, 2.02))
    s1 = _summary(10, 0.7, 0.9, 1.90)
    s1["config"]["seed"] = 1
    _write(tmp_path, "a1", s1)
    record = outer_sweep.study(outer_sweep.collect([tmp_path]))
    [setting] = record["schedules"][0]["settings"]
    assert setting["sync_seeds"] == [0] and setting["seed_list"] == [0, 1]
    assert abs(setting["vs_sync"] - (2.02 / 2.0 - 1)) < 1e-12
    assert "| +1.00% (seed 0) |" in outer_sweep.table(record)
    s1sync = _summary(1, None, None, 1.92)
    s1sync["config"]["seed"] = 1
    _write(tmp_path, "sync1", s1sync)
    record = outer_sweep.study(outer_sweep.collect([tmp_path]))
    [setting] = record["schedules"][0]["settings"]
    assert abs(setting["vs_sync"] - (1.96 / 1.96 - 1)) < 1e-12 and setting["sync_seeds"] == [0, 1]
    assert "| +0.00% |" in outer_sweep.table(record)
