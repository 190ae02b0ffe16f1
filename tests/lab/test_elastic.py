"""Elastic resume end to end: a 3-rank checkpoint resumed on 2 and on 4 ranks, a changed world
without elasticity, and the drill on the emulated cluster (the rules themselves:
tests/unit/test_elastic_rules.py)."""

import json

import pytest

from runs import needs_mnist, run, summary, tagged_processes


MNIST3 = ["+experiment=mnist_mlp", "trainer.epochs=1", "data.batch_size=250", "optimizer.lr=0.01",
          "trainer.lr_reference_batch=250",
          "trainer.checkpoint_every=10", "trainer.check_every=5", "trainer.log_every=20", "dist.threads_per_worker=1",
          "trainer.warmup_sync_steps=0", "trainer.eval_every_steps=20"]
# 60000 samples / (3 ranks x 250) = 80 steps per epoch; killed at 43: the newest checkpoint is step 40 (30,000 samples).


@pytest.fixture(scope="module")
def three_rank_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    run_dir = tmp / "run"
    r = run(*MNIST3, "dist.nproc=3", f"hydra.run.dir={run_dir}", tmp=tmp, fault="kill:1:43")
    assert r.returncode != 0 and "does 'kill' at step 43" in r.stderr
    assert (run_dir / "checkpoints" / "step-00000040.pt").exists()
    ref = run(*MNIST3, "dist.nproc=3", f"hydra.run.dir={tmp / 'reference'}", tmp=tmp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return run_dir, summary(tmp / "reference")


@needs_mnist
@pytest.mark.timeout(600)
def test_changed_world_without_elastic_is_a_clear_error(three_rank_checkpoint, tmp_path):
    r = run(*MNIST3, "dist.nproc=2", f"hydra.run.dir={three_rank_checkpoint[0]}", tmp=tmp_path, timeout=200)
    assert r.returncode != 0
    assert "was written by 3 ranks, this job has 2" in r.stderr and "trainer.elastic=true" in r.stderr
    assert not tagged_processes(r.tag)


@needs_mnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, per_epoch", [(2, 120), (4, 60)])
def test_three_rank_checkpoint_resumes_on_another_world(three_rank_checkpoint, world, per_epoch, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(three_rank_checkpoint[0], run_dir)
    r = run(*MNIST3, f"dist.nproc={world}", "trainer.elastic=true", f"hydra.run.dir={run_dir}", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(run_dir)
    rs = s["resharded"]
    assert (rs["old_world"], rs["new_world"], rs["samples_before"]) == (3, world, 30_000)
    assert rs["samples_before"] + rs["samples_after"] + rs["dropped"] == 60_000 and rs["dropped"] < world * 250
    assert rs["new_step"] == per_epoch - rs["batches_left_per_rank"] and s["steps"] == per_epoch
    assert rs["new_lr"] == pytest.approx(rs["old_lr"] * world / 3), "linear scaling follows the global batch"
    reference = three_rank_checkpoint[1]["test_accuracy"]  # the uninterrupted 3-rank run
    # the curve came back with it; "epoch" (not "step") is comparable across world sizes
    at_checkpoint = [e["test_accuracy"] for e in s["evals"] if e["epoch"] == pytest.approx(0.5)]
    assert s["world_size"] == world and len(at_checkpoint) == 1
    assert s["test_accuracy"] > at_checkpoint[0] + 0.05, "training goes on from the checkpoint"
    assert s["test_accuracy"] > reference - 0.1 and reference > 0.6
    assert f"elastic resume: world 3 -> {world} ranks" in r.stderr
    assert not tagged_processes(r.tag)
    json.dumps(rs)


DRILL = ["+experiment=mnist_mlp", "trainer.epochs=4", "data.batch_size=100", "trainer.checkpoint_every=20",
         "dist.threads_per_worker=1", "optimizer.lr=0.004", "trainer.lr_reference_batch=100",
         "trainer.warmup_sync_steps=0", "dist.timeout_s=60"]


@needs_mnist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lose_a_node_and_bring_it_back_on_the_emulated_cluster(netns, tmp_path):
    """Three torchrun agents (--nnodes 2:3) in network namespaces; node 2 is SIGKILLed after the
    checkpoint at step 40, the two others go on at world 2, node 2 comes back and the run ends at 3."""
    from pipesgd_lab.emulate.netns import list_namespaces

    run_dir, before = tmp_path / "run", set(list_namespaces())
    r = run("--run-dir", str(run_dir), "--kill-at-step", "40", "--rejoin-after", "20", "--timeout-s", "540", "--",
            *DRILL, tmp=tmp_path, prefix=("-m", "pipesgd_lab.emulate.drill"), timeout=580)
    assert r.returncode == 0, r.stderr[-4000:]
    d = json.loads((run_dir / "drill.json").read_text())
    assert d["agent_exit_codes"] == {"0": 0, "1": 0, "2": 0}
    assert d["steps_lost"] == d["killed_at_step"] - d["newest_checkpoint_step"] >= 0
    assert "world 3 -> 2 ranks" in d["shrink_line"] and "world 2 -> 3 ranks" in d["grow_line"]
    assert d["seconds_to_first_step"] < 120 and d["seconds_to_rejoin"] < 180
    assert d["world_size"] == 3 and d["test_accuracy"] > 0.9
    assert not tagged_processes(r.tag) and set(list_namespaces()) <= before, "no process or namespace left"
