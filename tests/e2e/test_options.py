"""Options end to end, through the Hydra entry: LARS, the parameter-server modes, the tree and
hierarchical allreduces train a few MNIST steps, and their bad settings fail before any worker
starts (the algorithms themselves are tested against references in tests/unit and
tests/distributed)."""

import json

import pytest

from runs import fast, train


# ---------------------------------------------------------------- bad input, named as typed

@pytest.mark.timeout(120)
@pytest.mark.parametrize("override,message", [
    ("optimizer.lr=-1", "optimizer.lr=-1 is invalid: must be a number > 0"),
    ("dist.backend=mpi", "dist.backend='mpi' is not known; allowed: auto, gloo, nccl"),
])
def test_a_bad_lr_or_backend_fails_before_workers_start(override, message, tmp_path, shared_data):
    """Named as the user typed it: the lr, not the rate scaled to the global batch (-0.5 here)."""
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), override, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert message in r.stderr, r.stderr[-2000:]
    assert "-0.5" not in r.stderr and "rank 1" not in r.stderr and "world=" not in r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- LARS

@pytest.mark.timeout(120)
def test_bad_trust_coefficient_fails_before_workers_start(tmp_path, shared_data):
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), "optimizer=lars",
              "optimizer.trust_coefficient=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert "optimizer.trust_coefficient=0 is invalid: must be a number > 0" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "training" not in r.stderr


@pytest.mark.timeout(300)
def test_lars_under_the_parameter_server_and_poly_warmup(tmp_path, shared_data):
    """LARS and the poly schedule drive a real run; the PS server rebuilds the optimizer class."""
    run_dir = tmp_path / "run"
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), "optimizer=lars", "optimizer.lr=2.0",
              "scheduler=poly", "scheduler.warmup_epochs=0.01", "trainer.mode=ps_sync", "trainer.max_steps=30",
              "dist.threads_per_worker=1", "data.eval_batch_size=2000", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["final_train_loss"] < 2.0 and s["test_accuracy"] > 0.5, s


# ---------------------------------------------------------------- parameter server

@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ps_async_converges_on_mnist(tmp_path, shared_data):
    """2 processes: rank 0 is worker + server, rank 1 a worker. Two epochs of the MNIST MLP (one
    epoch measured 96.0 %, too close to the bar for a random-order algorithm)."""
    run_dir = tmp_path / "run"
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), "trainer.mode=ps_async",
              "trainer.epochs=2", "trainer.log_every=100", "dist.threads_per_worker=1",
              f"hydra.run.dir={run_dir}", timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["mode"] == "ps_async" and s["world_size"] == 2
    assert s["test_accuracy"] >= 0.95, s["test_accuracy"]
    assert s["server_updates"] == 2 * s["steps"] and s["staleness_max"] >= 1


@pytest.mark.timeout(400)
def test_multirun_of_every_mode(tmp_path, shared_data):
    sweep = tmp_path / "sweep"
    modes = ["sync", "pipe", "ddp", "ps_sync", "ps_async"]
    r = train("-m", "+experiment=mnist_mlp", *fast(tmp_path, shared_data), "trainer.max_steps=3",
              f"trainer.mode={','.join(modes)}", "dist.threads_per_worker=1", "data.eval_batch_size=2000",
              f"hydra.sweep.dir={sweep}", timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert [s["mode"] for s in summaries] == modes
    assert all(s["predicted_iter_ms"] is not None and s["steps"] == 3 for s in summaries)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ps_sync", "ps_async"])
def test_ps_with_one_process_fails_before_workers_start(mode, tmp_path, shared_data):
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), f"trainer.mode={mode}", "dist.nproc=1",
              f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert f"dist.nproc=1 is invalid for trainer.mode={mode}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "training" not in r.stderr


# ---------------------------------------------------------------- tree and hierarchical allreduce

@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm,extra", [("tree", ["dist.nproc=3"]),
                                        ("hierarchical", ["dist.nproc=4", "comm.group_size=2"])])
def test_training_runs_over_tree_and_2x2_hierarchical(comm, extra, tmp_path, shared_data):
    run_dir = tmp_path / "run"
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), f"comm={comm}", *extra, "compressor=int8",
              "trainer.max_steps=3", "dist.threads_per_worker=1", "data.eval_batch_size=2000",
              f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["allreduce"] == comm and s["predicted_iter_ms"] is not None
    assert s["compression_ratio"] > 1.2  # rank 0 of hierarchical also sends fp32 inside its node


@pytest.mark.timeout(120)
def test_group_size_not_dividing_nproc_fails_before_workers_start(tmp_path, shared_data):
    r = train("+experiment=mnist_mlp", *fast(tmp_path, shared_data), "comm=hierarchical", "comm.group_size=2",
              "dist.nproc=3", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert "comm.group_size=2 is invalid with dist.nproc=3" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "training" not in r.stderr
