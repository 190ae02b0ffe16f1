"""The timing model of replicas of k ranks (pipesgd/timing/rounds.py's replica_terms, the map's
nodes-as-replicas arm): M = p / k replicas, a round's exchange of a 1/k shard between them on the
outer link plus the gather of the shards inside, the replica's allreduce every inner step on the
inner link; at k = 1 the price is today's."""

import pytest

from pipesgd.timing.model import Link, compression_ratio
from pipesgd.timing.rounds import replica_terms, round_iter_ms
from pipesgd.timing.scale import REPLICA_FAMILY, Scenario, family_verdict, replica_rows, round_h, round_rows

GPT = 1_240_000
OUTER, INNER = Link.from_bandwidth(5e6, 1e-3), Link.from_bandwidth(8e9, 1e-5)


def test_one_rank_per_replica_is_the_price_before_replicas():
    ratio = compression_ratio("int8", GPT, 4)
    for mode, width, delay in (("sync", 1, 0), ("pipe", 2, 0), ("pipe", 2, 2)):
        plain = round_iter_ms(mode, "ring", 4 * GPT, 4, OUTER, 0.2, 0.01, width, ratio, sync_every=10, fragments=2,
                              sync_delay=delay)
        assert round_iter_ms(mode, "ring", 4 * GPT, 4, OUTER, 0.2, 0.01, width, ratio, sync_every=10, fragments=2,
                             sync_delay=delay, ranks_per_replica=1, inner=INNER) == plain
    assert replica_terms(4 * GPT, 1, INNER) == (0.0, 0.0)


def test_two_replicas_of_two_ranks_by_hand():
    """Blocking rounds of H = 10 on 4 workers as 2 replicas of 2: a step is compute, update and the
    replica's ring of the gradient over 2 ranks (2 hops of half of it); a round adds the ring of a
    half between the 2 replicas (2 hops of a quarter) and the gather of the other half inside."""
    n, c, u, h = 4.0 * GPT, 0.2, 0.01, 10
    inner = 2 * (INNER.alpha + n / 2 * INNER.beta)
    exchange = 2 * (OUTER.alpha + n / 4 * OUTER.beta) + (INNER.alpha + n / 2 * INNER.beta)
    expected = (h * (c + inner) + exchange + h * u) / h
    got = round_iter_ms("sync", "ring", n, 4, OUTER, c, u, 1, sync_every=h, ranks_per_replica=2, inner=INNER)
    assert got == pytest.approx(1e3 * expected)
    # the slow link carries each replica's pseudo-gradient once: 4 replicas of 1 send twice as long on it
    four = round_iter_ms("sync", "ring", n, 4, OUTER, c, u, 1, sync_every=h)
    assert four > got
    with pytest.raises(ValueError, match="ranks_per_replica=3 must be an integer >= 1 that divides p=4"):
        round_iter_ms("sync", "ring", n, 4, OUTER, c, u, 1, sync_every=h, ranks_per_replica=3)


def test_the_map_prices_nodes_as_replicas_where_the_whole_model_hides_at_no_h():
    """Two nodes of 8 GPUs, 1 Gbit/s between the nodes (125 Mbit/s a GPU), a 1B-parameter model at
    250 ms a step: no H up to 100 hides 16 replicas' int8 exchange, a node as one replica at H = 50."""
    s = Scenario(1_000_000_000, 16, Link.from_bandwidth(125e6, 1e-3), 0.25, per_node=8,
                 intra=Link.from_bandwidth(3.6e12, 3.4e-6))
    assert round_h(s) is None
    rows = replica_rows(s, None)
    assert [r["sync_every"] for r in rows] == [50] and rows[0]["ranks_per_replica"] == 8 and rows[0]["hidden"]
    verdict = family_verdict([], rows, None)
    assert verdict["arm"] == f"{REPLICA_FAMILY}-h50" and verdict["family"] == "pipelined DiLoCo"
    flat = Scenario(GPT, 4, OUTER, 0.2)
    assert not any(r["family"] == REPLICA_FAMILY for r in round_rows(flat, 10)), "no nodes: no replica arm"
