"""trainer.mode=torchft_diloco as the study runs it: python -m pipesgd.train starts the lighthouse and
two replica groups, torchft's own streaming DiLoCo trains a few rounds of the MNIST MLP, and both
groups evaluate the same global weights. Skipped without torchft (pip install '.[live]'), except
under CI=true, where it fails."""

import os

import pytest

from needs_torchft import require_torchft
from runs import needs_mnist, run, summary, tagged_processes

require_torchft()

MLP_NUMEL = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10  # conf/model/mlp.yaml: hidden [256, 128]


@needs_mnist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fragments, delay", [(1, 0), (2, 1)])
def test_torchft_diloco_trains_two_replica_groups_in_rounds(tmp_path, fragments, delay):
    run_dir = tmp_path / "run"
    # the papers' outer step, pinned: at H = 4 the default is a plain averaging step, which four
    # rounds of this tiny run leave short of the bar below
    r = run("+experiment=mnist_mlp", "trainer.mode=torchft_diloco", "staleness=none", "trainer.sync_every=4",
            "outer_optimizer=nesterov",
            f"trainer.fragments={fragments}", f"trainer.sync_delay={delay}", "trainer.max_steps=16",
            "data.batch_size=250", "optimizer.lr=0.01", "trainer.lr_reference_batch=250",
            "trainer.eval_max_batches=4", "trainer.log_every=4", "trainer.check_every=null",
            "trainer.checkpoint_every=null", f"hydra.run.dir={run_dir}", tmp=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = summary(run_dir / "replica_0"), summary(run_dir / "replica_1")
    assert first["mode"] == second["mode"] == "torchft_diloco" and first["steps"] == second["steps"] == 16
    assert first["sync_every"] == 4 and first["fragments"] == fragments and first["sync_delay"] == delay
    assert first["rounds"] == second["rounds"] == 4 and first["live_skipped_commits"] == 0
    # the global weights, the same on both groups, are what each evaluates
    assert first["test_loss"] == second["test_loss"] and first["test_accuracy"] == second["test_accuracy"]
    assert first["averaged_replicas"] == 2
    # fp32 on the wire (torchft quantizes with Triton only): a ring's 2(p-1)/p of the model a round
    assert first["mean_bytes_per_step"] == pytest.approx(4 * MLP_NUMEL / 4, rel=0.01)
    assert first["test_accuracy"] > 0.5, "four rounds of DiLoCo on MNIST learn something"
    # the two groups share the machine's cores as two local workers would (each took them all before)
    assert first["threads_per_worker"] == second["threads_per_worker"] == int(
        os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2))
    assert summary(run_dir) == first
    assert not tagged_processes(r.tag)
