"""pipesgd_lab.bench.live_groups, the period-H study's launcher of torchft's arms on emulated nodes:
the groups' torchrun jobs keep the mode they are given, and bad arguments stop it before any node."""

import pytest

from needs_torchft import require_torchft
from pipesgd_lab.bench import live_groups
from pipesgd_lab.bench.live_drill_torchrun import group_command
from runs import ROOT, needs_mnist, run, summary, tagged_processes


def test_a_group_keeps_the_mode_it_is_given_and_is_live_otherwise():
    torchft = group_command(["+experiment=mnist_mlp", "trainer.mode=torchft_diloco"], "10.0.0.1", "http://h:1",
                            "run", 1, 2)
    assert [t for t in torchft if t.startswith("trainer.mode=")] == ["trainer.mode=torchft_diloco"]
    assert "trainer.live.replica=1" in torchft and "trainer.live.start_replicas=2" in torchft
    live = group_command(["+experiment=mnist_mlp"], "10.0.0.1", "http://h:1", "run", 0, 2)
    assert [t for t in live if t.startswith("trainer.mode=")] == ["trainer.mode=live"]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--rate", "1mbit", "--", "trainer.mode=torchft_diloco"], "hydra.run.dir=PATH"),
    (["--workers", "0", "--rate", "1mbit", "--", "hydra.run.dir=/tmp/x"], "--workers: must be an integer >= 1"),
    (["--workers", "2", "--rate", "fast", "--", "hydra.run.dir=/tmp/x"], "argument --rate: 'fast'"),
    (["--workers", "2", "--rate", "1mbit", "--", "trainer.live.replica=0", "hydra.run.dir=/tmp/x"],
     "sets trainer.live.lighthouse"),
])
def test_bad_arguments_stop_it_before_any_node_is_built(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        live_groups.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@needs_mnist
@pytest.mark.timeout(300)
def test_torchfts_groups_of_two_ranks_run_as_torchrun_jobs_and_evaluate_one_model(tmp_path):
    """Two replica groups of two ranks each on loopback (a curve of torchft's arms in the study's shape of
    several ranks per replica): every rank reads its own quarter of the data (global batch 4 x 125),
    both groups evaluate the same global weights over the whole sample, and group 0's summary is the run's."""
    require_torchft()
    run_dir = tmp_path / "run"
    r = run("+experiment=mnist_mlp", "trainer.mode=torchft_diloco", "staleness=none", "trainer.sync_every=4",
            "trainer.max_steps=16", "data.batch_size=125", "optimizer.lr=0.01", "trainer.lr_reference_batch=250",
            "trainer.eval_max_batches=2", "trainer.log_every=4", "trainer.check_every=null",
            "trainer.checkpoint_every=null", "trainer.live.min_replicas=2", f"hydra.run.dir={run_dir}", tmp=tmp_path,
            prefix=("-m", "pipesgd_lab.bench.live_groups", "--workers", "2", "--ranks-per-replica", "2", "--rate",
                    "loopback", "--timeout-s", "240", "--"), timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    for s in (first, second):
        assert (s["group_ranks"], s["world_size"], s["global_batch"], s["rounds"]) == (2, 2, 500, 4)
        assert s["averaged_replicas"] == 2 and s["live_skipped_commits"] == 0
    assert first["test_loss"] == second["test_loss"] and first["test_accuracy"] > 0.5
    assert summary(run_dir) == first
    # a group's other ranks write nowhere of their own: their run directory is rank 0's
    assert not [p for p in ROOT.glob("replica_*") if p.is_dir()], "a rank wrote beside the repository"
    assert not tagged_processes(r.tag)
