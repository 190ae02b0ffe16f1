"""The timing model's rounds (pipesgd/timing/rounds.py, docs/timing-model.md "Rounds"): a step's
price when the exchange comes once every H steps, in F fragments, launched τ steps early; the
smallest H that hides it; and the map's verdict on which family wins a link, and with what H."""

import json
import subprocess
import sys

import pytest

from pipesgd.timing.model import Link, comm_time, compression_ratio, predict_iter_ms
from pipesgd.timing.rounds import check_schedule, hides, round_iter_ms, round_step_s, smallest_h, streaming_schedule
from pipesgd.timing.scale import Scenario, arm_rows, family_verdict, round_h, round_rows

GPT = 1_240_000


@pytest.mark.parametrize("mode, width", [("sync", 1), ("pipe", 2), ("torchft_diloco", 1)])
def test_a_whole_model_round_without_delay_is_predict_iter_ms_at_sync_every(mode, width):
    link = Link.from_bandwidth(5e6, 1e-4)
    ratio = compression_ratio("int8", GPT, 2)
    for h in (2, 5, 25):
        expected = predict_iter_ms("sync" if width == 1 else "pipe", "ring", 4 * GPT, 2, link, 1.0, 0.01, width,
                                   ratio, sync_every=h)
        assert round_iter_ms(mode, "ring", 4 * GPT, 2, link, 1.0, 0.01, width, ratio, sync_every=h) \
            == pytest.approx(expected)


def test_the_rules_of_a_round_by_hand():
    # pipelined: the round's exchange under its compute, or the exchange where it is longer
    assert round_step_s(10.0, 1.0, 0.0, 25, width=2) == pytest.approx(1.0)
    assert round_step_s(30.0, 1.0, 0.0, 25, width=2) == pytest.approx(30 / 25)
    # five fragments on one thread: five exchanges of a fifth each per round
    assert round_step_s(3.0, 1.0, 0.0, 10, width=2, fragments=5) == pytest.approx(15 / 10)
    # blocking: the exchange after the round's compute
    assert round_step_s(40.0, 1.0, 0.0, 25) == pytest.approx(65 / 25)
    # torchft's delay: per fragment period of 5 steps, one launched 4 steps before it is waited for
    assert round_step_s(8.0, 1.0, 0.0, 25, fragments=5, sync_delay=4) == pytest.approx((1 + 8) / 5)
    assert round_step_s(3.0, 1.0, 0.0, 25, fragments=5, sync_delay=4) == pytest.approx(1.0)  # hidden
    # pipe at width 2 landing τ steps late: torchft's schedule's price
    assert round_step_s(8.0, 1.0, 0.0, 25, width=2, fragments=5, sync_delay=4) == pytest.approx((1 + 8) / 5)
    # compute slowed beside the exchange: the 4 steps take 4 + min(3, 8)·(1 - 1/2) = 5.5 s
    assert round_step_s(3.0, 1.0, 0.0, 25, fragments=5, sync_delay=4, overlap_slowdown=2.0) \
        == pytest.approx((1 + 5.5) / 5)


@pytest.mark.parametrize("h, f, delay, width, match", [(4, 3, 0, 1, "does not divide"), (4, 2, 2, 1, "must be below"),
                                                       (0, 1, 0, 1, "sync_every=0 is invalid"),
                                                       (10, 2, 1, 3, "sync_delay=1 says when .* got width 3")])
def test_a_schedule_that_is_none_is_refused_naming_the_setting(h, f, delay, width, match):
    with pytest.raises(ValueError, match=match):
        round_step_s(1.0, 1.0, 0.0, h, width, f, delay)


def test_the_smallest_h_that_hides_the_exchange():
    assert smallest_h(10.0, 1.0) == 25  # 10 s hides under 0.9 x 25 s, not under 0.9 x 10 s
    assert smallest_h(2.0, 1.0) == 5
    assert smallest_h(0.1, 1.0) == 2
    assert smallest_h(1000.0, 1.0) is None
    assert smallest_h(10.0, 1.0, candidates=(3, 12, 20)) == 12
    with pytest.raises(ValueError, match="fill"):
        smallest_h(1.0, 1.0, fill=0)


def test_torchfts_streaming_schedule_in_the_study():
    assert streaming_schedule(25) == (5, 4) and streaming_schedule(50) == (5, 9) and streaming_schedule(4) == (2, 1)
    for h in (2, 4, 5, 8, 10, 20, 25, 50, 100):
        f, delay = streaming_schedule(h)
        check_schedule(h, f, delay)


def test_the_map_picks_h_per_link_and_the_family_that_wins():
    slow, fast = (Scenario(GPT, 2, Link.from_bandwidth(bw, 1e-4), 1.0) for bw in (1e6, 10e9))
    assert round_h(slow) == 25 and round_h(fast) == 2
    rows = round_rows(slow, 25)
    arms = {r["arm"]: r for r in rows}
    assert {"diloco-pipelined-int8-h25", "torchft-diloco-h25", "torchft-diloco-h50", "torchft-diloco-h100",
            "torchft-streaming-h25"} <= set(arms)
    assert arms["diloco-pipelined-int8-h25"]["utilization"] == pytest.approx(1.0)
    # the pipeline on torchft's streaming schedule: priced as torchft's, a fifth of the int8 ring per fragment
    stream = arms["diloco-pipelined-int8-stream-h50"]
    assert (stream["fragments"], stream["sync_delay"], stream["width"]) == (5, 9, 2)
    int8 = comm_time("ring", 4 * GPT / 5, 2, slow.link, compression_ratio("int8", GPT, 2))
    assert stream["iter_ms"] == pytest.approx((1 + max(9.0, int8)) / 10 * 1e3)  # P = 10 steps, τ = 9 beside it
    assert stream["utilization"] == pytest.approx(1.0) and int8 < 9
    fp32 = comm_time("ring", 4 * GPT, 2, slow.link)  # torchft sends fp32: 4x the int8 ring's bytes
    assert arms["torchft-diloco-h25"]["iter_ms"] == pytest.approx((25 + fp32) / 25 * 1e3)
    verdict = family_verdict(arm_rows(slow), rows, 25)
    assert verdict["family"] == "pipelined DiLoCo" and verdict["h"] == 25
    # within a family, the tied arm landing soonest: fragments 4 steps late, not the whole round 25 late
    assert verdict["arm"] == "diloco-pipelined-int8-stream-h25" and verdict["lateness"] == 4
    # torchft hides its fp32 fragments at 2H (τ = 9 steps) and 4H (19): the sooner landing is its best
    assert verdict["best"]["torchft DiLoCo"]["arm"] == "torchft-streaming-h50"
    five = Scenario(GPT, 2, Link.from_bandwidth(5e6, 1e-4), 1.0)
    assert round_h(five) == 5
    verdict = family_verdict(arm_rows(five), round_rows(five, 5), 5)
    assert (verdict["arm"], verdict["h"], verdict["lateness"]) == ("diloco-pipelined-int8-stream-h10", 10, 1)
    # where every family hides its exchange, the tie goes to one that exchanges every step
    verdict = family_verdict(arm_rows(fast), round_rows(fast, 2), 2)
    assert verdict["family"] in ("DDP hook", "Pipe-SGD") and verdict["h"] is None


@pytest.mark.timeout(60)
def test_the_map_command_says_each_h_and_the_family():
    out = subprocess.run([sys.executable, "-m", "pipesgd.timing", "map", "--model", "gpt-shakespeare",
                          "--compute-ms", "1000", "--workers", "2", "--bandwidth", "1mbit", "--latency", "100us"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "rounds at H = 25" in out.stdout and "torchft-streaming-h100" in out.stdout
    # every pipelined arm hides its exchange here: the one whose average lands soonest wins the tie, the
    # streaming fragments landing 4 steps after their launch, not the whole round landing 25 later
    assert "family: pipelined DiLoCo (diloco-pipelined-int8-stream-h25 at H = 25, landing 4 steps" in out.stdout
    js = subprocess.run([sys.executable, "-m", "pipesgd.timing", "map", "--model", "gpt-shakespeare",
                         "--compute-ms", "1000", "--workers", "2", "--bandwidth", "1mbit", "--latency", "100us",
                         "--json"], capture_output=True, text=True, timeout=50)
    data = json.loads(js.stdout)
    assert data["family"]["family"] == "pipelined DiLoCo" and data["family"]["h_rule"] == 25
    assert len(data["rounds"]) == 11  # pipelined, blocking; torchft blocking, streaming, pipelined streaming at 3 H


def test_a_schedule_hides_only_with_a_margin_for_the_steps_jitter():
    # landing 4 steps late: a 2.1 s fragment fits 4 steps of 0.55 s (2.2 s) but not with 10 % to spare
    assert not hides(2.1, 0.55, 25, width=2, fragments=5, sync_delay=4)
    assert hides(2.1, 1.0, 25, width=2, fragments=5, sync_delay=4)
    assert hides(2.1, 0.55, 50, width=2, fragments=5, sync_delay=9)
    # pipelined rounds: all F fragments' exchanges within the round's compute; blocking never hides
    assert hides(10.5, 0.55, 25, width=2) and not hides(10.5, 0.40, 25, width=2)
    assert not hides(0.0, 1.0, 25, width=1)
    with pytest.raises(ValueError, match="sync_delay"):
        hides(1.0, 1.0, 10, width=2, fragments=5, sync_delay=2)


def test_on_a_faster_step_the_map_lands_later_rather_than_wait():
    # the GPT at 1 Mbit/s with 0.55 s of compute a step: five int8 fragments landing 4 steps late only
    # just fit (no margin), so the pipelined family's best lands 9 steps late at 2H
    fast = Scenario(GPT, 2, Link.from_bandwidth(1e6, 1e-4), 0.55)
    h = round_h(fast)
    rows = round_rows(fast, h)
    arms = {r["arm"]: r for r in rows}
    assert h == 25 and not arms["diloco-pipelined-int8-stream-h25"]["hidden"]
    assert arms["diloco-pipelined-int8-stream-h50"]["hidden"]
    verdict = family_verdict(arm_rows(fast), rows, h)
    assert verdict["best"]["pipelined DiLoCo"]["arm"] == "diloco-pipelined-int8-stream-h50"
