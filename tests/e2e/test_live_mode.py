"""trainer.mode=live as a user runs it: python -m pipesgd.train starts the lighthouse and two
replica groups, each a lone process in its own run subdirectory; they train on their own data
shards and end with identical weights. The kill/rejoin behaviour: tests/distributed/test_live.py.
Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

import importlib.util
import os

import pytest

from runs import needs_mnist, run, summary, tagged_processes

if importlib.util.find_spec("torchft") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("torchft is not installed; under CI=true the live tests must run (pip install '.[live]')",
                    pytrace=False)
    pytest.skip("torchft is not installed (pip install '.[live]')", allow_module_level=True)


# the ring with int8 on torchft's group (comm=auto picks the ring there); lookahead over its native allreduce
@needs_mnist
@pytest.mark.parametrize("staleness, comm, compressor", [("none", "auto", "int8"), ("lookahead", "native", "none")])
@pytest.mark.timeout(200)
def test_the_live_mode_trains_two_replica_groups_to_the_same_model(tmp_path, staleness, comm, compressor):
    run_dir = tmp_path / "run"
    r = run("+experiment=mnist_mlp", "trainer.mode=live", f"staleness={staleness}", f"comm={comm}",
            f"compressor={compressor}", "trainer.max_steps=20",
            "data.batch_size=250",
            "optimizer.lr=0.01", "trainer.lr_reference_batch=250", "dist.threads_per_worker=1",
            "trainer.eval_max_batches=4", "trainer.log_every=10", "trainer.checkpoint_every=7", f"hydra.run.dir={run_dir}", tmp=tmp_path,
            timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    assert first["mode"] == second["mode"] == "live" and first["steps"] == second["steps"] == 20
    assert first["staleness"] == staleness and first["compressor"] == compressor
    assert first["allreduce"] == ("ring" if comm == "auto" else comm)  # what ran, over torchft's group
    # one global batch of 2 x 250 over two shards; the same averaged updates on both replicas
    assert first["global_batch"] == 500
    assert first["test_accuracy"] == second["test_accuracy"] and first["test_loss"] == second["test_loss"]
    assert summary(run_dir) == first
    assert not tagged_processes(r.tag)


@pytest.mark.timeout(60)
def test_without_torchft_the_mode_names_the_extra(monkeypatch):
    import sys

    from pipesgd.live import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pipesgd\[live\]'"):
        require_torchft()
