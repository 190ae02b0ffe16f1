"""Each arm's warm-up at its own price, not another arm's: a timing run times the warm-up steps as
they run (PowerSGD's plain allreduce steps like a pipe arm's synchronous ones), and the report
composes the headline with those rates and the earlier accounting beside it."""

import json
from types import SimpleNamespace

import pytest

from pipesgd_lab.bench import tta, tta_report
from pipesgd_lab.bench import tta_compose as c
from pipesgd_lab.bench.tta_shape import Shape
from pipesgd.observability.hostinfo import fingerprint
from tests.lab.test_tta_records import _record, _summary

PINNED = {"rule": "rank", "allowed": [0, 1], "core": 0}


def test_a_powersgd_timing_run_times_its_plain_steps_then_its_compressed_ones(tmp_path, monkeypatch):
    a = SimpleNamespace(skip=2, steps=4, recipe="resnet_cifar_tta", workers=2, shape=Shape(2), overrides=[], timeout_s=60.0,
                        mtu=9000, probe_s=0.02)
    seen = {}

    def run(cmd, log_path, timeout_s):  # the training run: 2 + 20 plain steps at 300 ms, 2 + 4 at 100 ms
        seen["cmd"] = cmd
        run_dir = tmp_path / "r"
        run_dir.mkdir()
        iter_ms = [300.0] * 22 + [100.0] * 6
        (run_dir / "history.json").write_text(json.dumps({
            "iter_ms": iter_ms, "wall_time": [float(i) for i in range(len(iter_ms))], "compute_ms": iter_ms,
            "exposed_comm_ms": iter_ms}))
        (run_dir / "summary.json").write_text(json.dumps({"evals": [{"eval_s": 4.0}], "placement": PINNED}))
        return True

    monkeypatch.setattr(tta, "_run", run)
    row = tta.timing_row(a, "ddp-powersgd", "loopback", tmp_path / "r", 0)
    assert "compressor.ddp_start_iter=22" in seen["cmd"] and "trainer.warmup_sync_steps=0" in seen["cmd"]
    assert row["warmup_iter_ms"] == [300.0] * 20 and row["iter_ms"] == [100.0] * 4
    assert row["window"] == {"first": 24, "steps": 4, "warmup": [2, 22]}
    assert row["host"] == fingerprint() and row["placement"] == PINNED, "the row says where rank 0 ran"
    assert row["host_speed"]["before"]["gflops"] > 0 and row["host_speed"]["after"]["seconds"] == 0.02
    block = tta_report.timing_by_link([row | {"link": "100mbit"}])["100mbit"]
    assert block["warmup_ms"] == {"ddp-powersgd": 300.0} and block["step_ms"] == {"ddp-powersgd": 100.0}


def test_the_report_composes_both_accountings_and_says_which_is_the_headline(tmp_path):
    a = SimpleNamespace(arms=["sync", "pipe+lookahead"], seeds=[0], dir=tmp_path, records=tmp_path / "records",
                        recipe="resnet_cifar_tta", overrides=[], timing=None, workers=2, shape=Shape(2), mixed_hosts=False,
                        validations=None)
    pipe = _summary(mode="pipe", width=2, staleness="lookahead", warmup_sync_steps=100)
    used = [_record("sync", _summary()), _record("pipe+lookahead", pipe)]
    timing = {"100mbit": {"step_ms": {"sync": 200.0, "pipe+lookahead": 100.0}, "warmup_ms": {}, "eval_s": 0.0,
                          "repeat_median_ms": {}, "cpu": {}, "commits": [], "measured": ["d", "d"], "mtu": 9000,
                          "windows": {}, "hosts": ["unknown"]}}
    result = tta_report.build_result(a, used, [], timing)
    assert result["warmup_accounting"]["headline"] == c.OWN_RATE and result["warmup_accounting"]["also"] == [c.OTHER_ARM_RATE]
    block = result["links"]["100mbit"]
    # 300 steps of pipe+lookahead, 100 of them warm-up: at its own step time, or at sync's
    assert block["time_to_target_s"]["pipe+lookahead"] == pytest.approx(30.0)
    assert block["accountings"][c.OTHER_ARM_RATE]["time_to_target_s"]["pipe+lookahead"] == pytest.approx(40.0)
    assert block["warmup_source"] == {"pipe+lookahead": "own step time (warm-up not timed)"}
    assert "own rate (headline)" in c.accounting_table(result)


def test_a_ratio_whose_seed_or_round_range_includes_one_is_a_tie():
    runs = [{"name": "sync", "seed": 0, "curve": [[100, 90.0]]}, {"name": "sync", "seed": 1, "curve": [[120, 90.0]]},
            {"name": "pipe", "seed": 0, "curve": [[100, 90.0]]}, {"name": "pipe", "seed": 1, "curve": [[130, 90.0]]}]
    rounds = {"sync": [200.0, 220.0], "pipe": [180.0, 150.0]}
    block = c.compose_link(runs, {"sync": 210.0, "pipe": 165.0}, 0.0, {}, 90.0)
    ranges = c.speedup_ranges(block, runs, rounds, {})
    # every (sync seed, pipe seed, round): low = 100*200 / (130*180), high = 120*220 / (100*150)
    assert ranges["sync"]["pipe"]["range"] == [pytest.approx(100 * 200 / (130 * 180)), pytest.approx(120 * 220 / (100 * 150))]
    assert ranges["sync"]["pipe"]["verdict"] == "tie" and block["speedup"]["sync"]["pipe"] > 1
    faster = c.speedup_ranges(block, runs, {"sync": [200.0, 220.0], "pipe": [100.0, 90.0]}, {})
    assert faster["sync"]["pipe"]["verdict"] == "sooner"
    assert c.verdict(0.8, 0.99) == "later" and c.verdict(0.99, 1.01) == "tie"


def test_ddp_with_the_pipelined_powersgd_hook_is_a_pipelined_arm_with_powersgds_warm_up():
    """The pipelined DDP hook's arm: DDP at width 2 around torch's PowerSGD hook with the lookahead rule. The
    study composes it as a pipelined arm against the DDP baselines, and times its warm-up (the
    hook's plain steps) at its own rate, as DDP + PowerSGD's."""
    from pipesgd_lab.bench.tta_arms import ARMS, WARMUP_KEYS

    arm = "ddp-pipelined+lookahead-powersgd"
    assert {"trainer.mode=ddp", "trainer.width=2", "staleness=lookahead", "compressor=powersgd"} <= set(ARMS[arm])
    assert WARMUP_KEYS[arm] == "compressor.ddp_start_iter"
    assert c.pipelined(arm) and c.pipelined("pipe+lookahead-int8")
    assert not any(c.pipelined(a) for a in (*c.DDP_ARMS, "sync", c.COMPUTE_ARM))
    cap = c.ceiling({c.COMPUTE_ARM: 100.0, "ddp-powersgd": 200.0, arm: 120.0, "sync": 300.0})
    assert cap["best_ddp"] == "ddp-powersgd" and cap["captured"] == {arm: pytest.approx(0.8)}
