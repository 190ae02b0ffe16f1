"""trainer.mode=live as a user runs it: python -m pipesgd.train starts the lighthouse and two
replica groups, each a lone process in its own run subdirectory; they train on their own data
shards and end with identical weights, checked on the way (trainer.check_every). The kill/rejoin
behaviour: tests/distributed/test_live.py.
Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

import json

import pytest

from runs import needs_mnist, run, summary, tagged_processes
from needs_torchft import require_torchft

require_torchft()


# the ring with int8 on torchft's group (comm=auto picks the ring there); lookahead over its native
# allreduce; dga, whose groups hold weights of their own until the last flush (checks compare w̄);
# PowerSGD (its residual and warm start in each group's checkpoints) over the ring
@needs_mnist
@pytest.mark.parametrize("staleness, comm, compressor", [("none", "auto", "int8"), ("lookahead", "native", "none"),
                                                         ("dga", "auto", "none"), ("none", "auto", "powersgd")])
@pytest.mark.timeout(200)
def test_the_live_mode_trains_two_replica_groups_to_the_same_model(tmp_path, staleness, comm, compressor):
    run_dir = tmp_path / "run"
    r = run("+experiment=mnist_mlp", "trainer.mode=live", f"staleness={staleness}", f"comm={comm}",
            f"compressor={compressor}", "trainer.max_steps=20",
            "data.batch_size=250",
            "optimizer.lr=0.01", "trainer.lr_reference_batch=250", "dist.threads_per_worker=1",
            "trainer.eval_max_batches=4", "trainer.log_every=10", "trainer.checkpoint_every=7", "trainer.check_every=3",
            f"hydra.run.dir={run_dir}", tmp=tmp_path,
            timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    assert first["mode"] == second["mode"] == "live" and first["steps"] == second["steps"] == 20
    assert first["staleness"] == staleness and first["compressor"] == compressor
    assert first["allreduce"] == ("ring" if comm == "auto" else comm)  # what ran, over torchft's group
    # one global batch of 2 x 250 over two shards; the same averaged updates on both replicas
    assert first["global_batch"] == 500
    assert first["test_accuracy"] == second["test_accuracy"] and first["test_loss"] == second["test_loss"]
    # the evaluation averages the groups' recent losses (each its own shard's) over the quorum's two groups
    assert first["averaged_replicas"] == second["averaged_replicas"] == 2
    assert first["final_train_loss"] == second["final_train_loss"]
    # trainer.check_every reaches the engine, whose reductions carry the check (every 3 committed updates)
    assert first["live_replica_checks"] >= 1 and second["live_replica_checks"] >= 1
    assert summary(run_dir) == first
    assert not tagged_processes(r.tag)


@pytest.mark.timeout(60)
def test_without_torchft_the_mode_names_the_extra(monkeypatch):
    import sys

    from pipesgd.live import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pipesgd\[live\]'"):
        require_torchft()
