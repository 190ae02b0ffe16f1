"""Replicas of k ranks (``dist.ranks_per_replica``) as a user runs them: the trainer with two
replicas of two ranks and half the batch ends where two replicas of one rank with the whole batch
end, and a worker SIGKILLed mid-round with a round in flight resumes bit-identical
(docs/period-h.md, "Replicas of k ranks")."""

from __future__ import annotations

import pytest

from runs import killed_and_resumed, needs_mnist, run, summary

# 30 steps per epoch (60000 / 2 replicas / 1000 samples a replica); rounds of 3 steps
MNIST = ["+experiment=mnist_mlp", "trainer.max_steps=16", "optimizer.lr=0.05", "trainer.lr_reference_batch=null",
         "trainer.log_every=8", "dist.threads_per_worker=1", "trainer.eval_every_steps=8", "trainer.sync_every=3",
         "trainer.check_every=2"]


@needs_mnist
@pytest.mark.timeout(600)
def test_two_replicas_of_two_ranks_train_as_two_of_one_with_twice_the_batch(tmp_path):
    many = run(*MNIST, "dist.nproc=4", "dist.ranks_per_replica=2", "data.batch_size=500",
               f"hydra.run.dir={tmp_path / 'many'}", tmp=tmp_path)
    assert many.returncode == 0, many.stderr[-3000:]
    one = run(*MNIST, "dist.nproc=2", "data.batch_size=1000", f"hydra.run.dir={tmp_path / 'one'}", tmp=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = summary(tmp_path / "many"), summary(tmp_path / "one")
    assert (a["world_size"], a["replicas"], a["ranks_per_replica"]) == (4, 2, 2)
    assert (b["world_size"], b["replicas"], b["ranks_per_replica"]) == (2, 2, 1)
    assert a["global_batch"] == b["global_batch"] == 2000 and a["lr"] == b["lr"]
    for x, y in zip(a["evals"], b["evals"]):
        assert x["test_loss"] == pytest.approx(y["test_loss"], rel=1e-5, abs=1e-6)
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5) and a["test_accuracy"] > 0.4
    # each rank of a replica carries half its pseudo-gradient over the slow link
    assert a["mean_bytes_per_step"] == pytest.approx(b["mean_bytes_per_step"] / 2, rel=0.01)
    assert a["bytes_inside_replica"] > 0 and "bytes_inside_replica" not in b
    assert "replicas: 2 of 2 ranks each" in many.stderr


@needs_mnist
@pytest.mark.timeout(600)
def test_killed_worker_of_a_replica_resumes_mid_round_and_mid_flight_bit_identical(tmp_path):
    """Checkpoint at step 8 (inside round 3, round 2 in flight at width 2), rank 1 (replica 0)
    killed at step 11; the job restarts every worker from step 8 and ends on the same weights."""
    args = [*MNIST, "dist.nproc=4", "dist.ranks_per_replica=2", "data.batch_size=500", "compressor=int8",
            "trainer.checkpoint_every=8"]
    killed_and_resumed(args, tmp_path, rank=1, at=11, checkpoint=8, steps=16)


@needs_mnist
@pytest.mark.timeout(300)
def test_replica_checks_find_a_rank_whose_weights_left_its_replicas_mid_round(tmp_path):
    """Rank 1's weights perturbed after step 4's backward (the first of round 2, steps 4-6): the
    anchors of every rank still agree, but the two ranks of replica 0 no longer hold the same
    weights, which the check at step 4 names (trainer.check_every=2; at the round's end, step 6,
    both would restart from the anchor and agree again)."""
    r = run(*MNIST, "dist.nproc=4", "dist.ranks_per_replica=2", "data.batch_size=500",
            f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path, fault="perturb:1:4")
    assert r.returncode != 0
    assert "replica 0 diverged at step 4: its ranks 0-1 hold different weights" in r.stderr, r.stderr[-3000:]
