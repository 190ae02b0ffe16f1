"""The scale map's arms come from the registries (a new compressor or mode is a new arm, with no
list to edit), what an arm costs from what its plugins declare, and DDP with the pipelined hook
(docs/ddp-hook.md) is priced as Pipe-SGD width 2 over DDP's buckets: by hand on a small case."""

from __future__ import annotations

import math

import pytest

from pipesgd.compress import REGISTRY as COMPRESSORS
from pipesgd.compress.none import NoCompression
from pipesgd.timing import Link, predict_iter_ms
from pipesgd.timing.scale import ALL_ARMS, ARMS, Arm, Scenario, arm_rows, arm_table, summarize

ALPHA, RATE = 50e-6, 25e6  # the 25 Mbit/s link of the crossover study, 50 µs per message
BETA = 8 / RATE
M = 269_722 * 4  # ResNet-20's fp32 gradient: DDP's buckets are 1 MiB (the first) and the rest
REST = M - 2**20


def test_the_arms_are_the_registered_modes_and_compressors_one_per_cost():
    assert list(ARMS) == ["sync", "ddp", "ddp-fp16", "ddp-powersgd", "pipe", "pipe-fp16", "pipe-int8"]
    assert list(ALL_ARMS) == [*ARMS, "ddp-pipelined", "ddp-pipelined-fp16", "ddp-pipelined-powersgd"]
    assert ALL_ARMS["ddp-pipelined-powersgd"] == Arm("ddp", 2, "powersgd")
    # bf16 costs what fp16 does (2 bytes a value) and fp16 is the more exact; live costs what pipe does;
    # a compressed width-1 pipeline never beats the same compressor at width 2; ps_* and local reduce
    # over no allreduce
    assert not {"pipe-bf16", "ddp-bf16", "live", "sync-int8", "ps_sync", "local"} & set(ALL_ARMS)


def test_a_new_compressor_is_a_new_arm_priced_by_the_payload_it_declares():
    @COMPRESSORS.register("tri")
    class ThreeBytes(NoCompression):  # a 24-bit code: 3 bytes a value, no DDP hook
        identity = False
        rel_error = 2.0**-15

        def payload_bytes(self, numel: int, elem_size: int = 4) -> int:
            return 3 * numel

        def ddp_hook(self):
            return None

    try:
        arms = arm_table()
        assert arms["pipe-tri"] == Arm("pipe", 2, "tri") and "ddp-tri" not in arms, "DDP carries hooks only"
        row, = arm_rows(Scenario(M // 4, 2, Link(ALPHA, BETA), 0.001), ["pipe-tri"], arms)
        assert row["ratio"] == pytest.approx(4 / 3)
        assert row["iter_ms"] == pytest.approx(1e3 * (2 * ALPHA + 3 / 4 * M * BETA))  # comm-bound ring, p = 2
    finally:
        COMPRESSORS.unregister("tri")
    assert "pipe-tri" not in arm_table()


def test_ddp_with_the_pipelined_hook_is_pipe_sgd_width_2_over_ddps_buckets():
    """At 25 Mbit/s, p = 2, the ring sends a bucket of b bytes as two messages of b/2: 2α + bβ. The
    pipelined hook's step is max(compute + update, every bucket's reduction), pipe's rule; it pays
    one more bucket's α than pipe's one flat buffer, and hides what plain DDP waits for."""
    s = Scenario(M // 4, 2, Link(ALPHA, BETA), 0.030)
    rows = {r["arm"]: r for r in arm_rows(s, list(ALL_ARMS))}
    assert rows["pipe"]["iter_ms"] == pytest.approx(1e3 * (2 * ALPHA + M * BETA))
    assert rows["ddp-pipelined"]["iter_ms"] == pytest.approx(1e3 * (4 * ALPHA + M * BETA))  # two buckets
    assert rows["ddp-pipelined-fp16"]["iter_ms"] == pytest.approx(1e3 * (4 * ALPHA + M / 2 * BETA))
    assert rows["ddp"]["iter_ms"] > rows["ddp-pipelined"]["iter_ms"]
    # PowerSGD (no layer shapes: each bucket one square matrix, rank 2): three allreduces a bucket
    # (no dense values, P, Q of side·2 values each); 3.7 ms of them hide behind 30 ms of compute
    comm = sum(3 * 2 * ALPHA + 2 * 4 * (2 * math.sqrt(b / 4)) * BETA for b in (2**20, REST))
    assert comm < 0.030 and rows["ddp-pipelined-powersgd"]["iter_ms"] == pytest.approx(30.0)
    assert rows["ddp-pipelined-powersgd"]["ratio"] == rows["ddp-powersgd"]["ratio"]
    slowed = {r["arm"]: r for r in arm_rows(Scenario(M // 4, 2, Link(ALPHA, BETA), 0.030, update_s=0.002,
                                                     overlap_slowdown=1.5), ["ddp-pipelined-powersgd"])}
    # compute runs 1.5x slower while the reductions run beside it, then the update: pipe's terms
    assert slowed["ddp-pipelined-powersgd"]["iter_ms"] == pytest.approx(1e3 * (0.030 + comm * (1 - 1 / 1.5) + 0.002))
    # one model: a training run of trainer.mode=ddp trainer.width=2 predicts what the map's arm says
    assert predict_iter_ms("ddp", "ring", M, 2, Link(ALPHA, BETA), 0.030, width=2) == \
        pytest.approx(rows["ddp-pipelined"]["iter_ms"], rel=1e-12)
    assert predict_iter_ms("ddp", "ring", M, 2, Link(ALPHA, BETA), 0.030, width=1) == \
        pytest.approx(rows["ddp"]["iter_ms"], rel=1e-12)
    # a pipelined DDP arm is a pipelined arm in the summary, never the DDP baseline
    summary = summarize(list(rows.values()))
    assert summary["winner"] == summary["best_pipe"] == "ddp-pipelined-powersgd"
    assert summary["best_ddp"] == "ddp-powersgd"
    assert summarize([r for r in rows.values() if r["arm"] in ARMS])["best_pipe"] == "pipe-int8"


def test_the_map_cli_takes_the_pipelined_ddp_arms_when_asked(capsys):
    from pipesgd.timing.__main__ import main

    argv = ["map", "--params", str(M // 4), "--compute-ms", "30", "--bandwidth", "25mbit", "--latency", "50us",
            "--workers", "2"]
    assert main(argv) == 0
    assert "ddp-pipelined" not in capsys.readouterr().out
    assert main([*argv, "--arms", "all"]) == 0
    out = capsys.readouterr().out
    assert "\nddp-pipelined-powersgd " in out and "winner: ddp-pipelined-powersgd" in out
    assert main([*argv, "--arms", "sync,ddp-pipelined"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("winner:")] == [
        "winner: ddp-pipelined"]  # the rounds' table and the family's verdict follow it
    with pytest.raises(SystemExit):
        main([*argv, "--arms", "pipe,dpp"])
    assert "argument --arms: 'pipe,dpp': arms must be among sync, ddp" in capsys.readouterr().err
