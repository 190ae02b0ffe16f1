"""``dist.ranks_per_replica`` refused before any worker starts, each refusal naming its option and
value: a world it does not divide, modes and periods without replicas of several ranks, a
reduction that cannot run on a shard, an allreduce on the world's node groups; at 1 (the default)
a run's checkpoint digest is the one it had before the key existed."""

from __future__ import annotations

import pytest

from pipesgd.config import ConfigError, validate
from test_config import composed

ROUNDS = ("trainer.mode=pipe", "trainer.sync_every=4", "dist.nproc=4")


@pytest.mark.parametrize("overrides,message", [
    (("dist.ranks_per_replica=3", *ROUNDS), r"dist.ranks_per_replica=3 does not divide the world size \(dist.nproc=4\)"),
    (("dist.ranks_per_replica=0", *ROUNDS), r"dist.ranks_per_replica=0 is invalid: must be an integer >= 1"),
    (("dist.ranks_per_replica=2", "trainer.mode=pipe", "dist.nproc=4"),
     r"dist.ranks_per_replica=2 makes replicas of several ranks that exchange rounds: at trainer.sync_every=1"),
    (("dist.ranks_per_replica=2", "trainer.mode=ddp", "dist.nproc=4"),
     r"dist.ranks_per_replica=2 is not available with trainer.mode=ddp"),
    (("dist.ranks_per_replica=2", "trainer.mode=ps_sync", "dist.nproc=4"),
     r"dist.ranks_per_replica=2 is not available with trainer.mode=ps_sync"),
    (("dist.ranks_per_replica=2", *ROUNDS, "compressor=powersgd"),
     r"compressor=powersgd is not available with dist.ranks_per_replica=2"),
    (("dist.ranks_per_replica=2", *ROUNDS, "comm=hierarchical"),
     r"comm=hierarchical is not available with dist.ranks_per_replica=2"),
])
def test_every_refusal_names_its_option(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(composed(*overrides))


def test_torchft_diloco_refuses_replicas_of_several_ranks_until_it_declares_them():
    from pipesgd.modes import get_mode

    if get_mode("torchft_diloco").replicas:
        pytest.skip("torchft_diloco declares replicas of several ranks")
    cfg = composed("dist.ranks_per_replica=2", "trainer.mode=torchft_diloco", "trainer.sync_every=4", "dist.nproc=4",
                   "trainer.warmup_sync_steps=0")
    with pytest.raises(ConfigError, match="dist.ranks_per_replica=2 is not available with trainer.mode=torchft_diloco"):
        validate(cfg)


def test_replicas_of_two_ranks_with_rounds_pass_and_torchrun_reads_the_world(monkeypatch):
    validate(composed("dist.ranks_per_replica=2", *ROUNDS, "compressor=int8"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"dist.ranks_per_replica=4 does not divide the world size \(WORLD_SIZE=6\)"):
        validate(composed("dist.ranks_per_replica=4", *ROUNDS))


def test_the_default_keeps_the_checkpoint_digest_of_runs_before_it():
    from pipesgd.reliability.checkpoint import config_digest

    base = {"trainer": {"mode": "pipe", "sync_every": 4}, "dist": {"nproc": 4}, "optimizer": {"lr": 0.1}}
    one = {**base, "dist": {"nproc": 4, "ranks_per_replica": 1}}
    two = {**base, "dist": {"nproc": 4, "ranks_per_replica": 2}}
    assert config_digest(one) == config_digest(base) != config_digest(two)
    auto = {**base, "dist": {"nproc": 4, "ranks_per_replica": None}}
    assert config_digest(auto) == config_digest(base)


@pytest.mark.parametrize("local,world,rounds,k", [
    (2, 4, True, 2),    # torchrun, two nodes of two: a node is a replica
    (8, 16, True, 8),   # two nodes of eight
    (4, 4, True, 1),    # one node: every rank a replica, as before
    (2, 4, False, 1),   # no rounds (sync_every=1, or a mode without replicas): nothing to group
    (0, 1, True, 1),    # not under torchrun (no LOCAL_WORLD_SIZE)
    (3, 4, True, 1),    # a local size that does not divide the world is never guessed into replicas
])
def test_unset_a_replica_is_a_torchrun_node_where_there_are_rounds(monkeypatch, local, world, rounds, k):
    from pipesgd.dist import ranks_per_replica

    monkeypatch.setenv("WORLD_SIZE", str(world))
    if local:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    else:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_replica(None, rounds) == k
    assert ranks_per_replica(1, rounds) == 1 and ranks_per_replica(2, rounds) == 2  # a setting is kept


def test_unset_under_two_torchrun_nodes_the_config_checks_the_node_as_a_replica(monkeypatch):
    """Two nodes of two ranks, rounds: null means k = 2, which a mode without replicas never sees
    (it resolves to 1 there and passes), while rounds with PowerSGD are refused naming the key."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    validate(composed(*ROUNDS, "compressor=int8"))
    validate(composed("trainer.mode=sync", "trainer.width=1"))
    with pytest.raises(ConfigError, match="compressor=powersgd is not available with dist.ranks_per_replica=2"):
        validate(composed(*ROUNDS, "compressor=powersgd"))
