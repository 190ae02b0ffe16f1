"""Elastic resume: the re-sharding rule (every remaining sample exactly once), the per-rank state
rules, the step/schedule remap, and a 3-rank checkpoint resumed on 2 and on 4 ranks."""

import json

import pytest
import torch

from pipesgd import elastic
from pipesgd.data.loader import ShardedLoader, Split

from runs import needs_mnist, run, summary, tagged_processes


def loader(n: int, rank: int, world: int, batch: int = 4, augment: bool = False) -> ShardedLoader:
    images = torch.arange(n, dtype=torch.uint8).repeat_interleave(3 * 8 * 8).reshape(n, 3, 8, 8) if augment else \
        torch.zeros(n, 1, 2, 2, dtype=torch.uint8)
    return ShardedLoader(Split(images, torch.arange(n)), batch, rank, world, seed=7, augment=augment)


def trained(n: int, world: int, epoch: int, consumed: int, batch: int = 4) -> list[list[int]]:
    """Each rank's sample ids for the rest of ``epoch`` after ``consumed`` samples."""
    out = []
    for r in range(world):
        ld = loader(n, r, world, batch)
        out.append([int(i) for _, y in ld.iter_epoch(epoch, 0, consumed) for i in y])
    return out


@pytest.mark.parametrize("n, old, new, steps", [(103, 3, 2, 5), (103, 3, 4, 5), (100, 3, 2, 0), (97, 2, 5, 3),
                                                (120, 4, 3, 7)])
def test_reshard_trains_every_remaining_sample_exactly_once(n, old, new, steps):
    b = 4
    before = trained(n, old, 2, 0, b)
    consumed = steps * b * old
    first = {i for rank in before for i in rank[: steps * b]}  # what the old world trained
    after = trained(n, new, 2, consumed, b)
    flat = [i for rank in after for i in rank]
    assert len(flat) == len(set(flat)), "no sample twice"
    assert not first & set(flat), "nothing the old world trained comes back"
    assert len({len(r) for r in after}) == 1, "every rank the same number of batches"
    dropped = n - consumed - len(flat)
    assert 0 <= dropped < new * b, "only the last partial global batch is dropped"
    assert loader(n, 0, new, b).batches_left(consumed) * b == len(after[0])
    # the dealt-out rest is the rest of the epoch's one permutation, in order
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(
        __import__("pipesgd.data.loader", fromlist=["mix_seed"]).mix_seed(7, 2))).tolist()
    assert sorted(flat) == sorted(perm[consumed: consumed + len(flat)])


def test_same_world_position_reproduces_the_full_pass_with_augmentation():
    full = [x for x, _ in loader(64, 1, 2, augment=True).iter_epoch(3)]
    rest = [x for x, _ in loader(64, 1, 2, augment=True).iter_epoch(3, 0, consumed=3 * 4 * 2)]
    assert len(rest) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(full[3:], rest))


def _rank(i: int) -> dict:
    return {"engine": {"steps": 10, "staleness": {"local": [torch.full((3,), float(i))]},
                       "reduction": {"residual": torch.full((3,), float(i)), "q": [torch.ones(2)]}},
            "rng": {"r": i}, "buffers": {"bn": torch.full((2,), float(i))}, "losses": [float(i)], "compressor": {}}


def test_surviving_ranks_keep_their_state_and_new_ranks_take_a_donors_without_its_residual():
    ranks = [_rank(i) for i in range(3)]
    assert [elastic.rank_state(ranks, r) is ranks[r] for r in range(2)] == [True, True], "shrink: own state"
    new = elastic.rank_state(ranks, 4)  # grow to 5: rank 4 takes old rank 1's (4 mod 3)
    assert new["buffers"]["bn"][0] == 1 and new["engine"]["staleness"]["local"][0][0] == 1 and new["new_rank"]
    assert "residual" not in new["engine"]["reduction"], "a residual is owed by its own rank only"
    assert new["engine"]["reduction"]["q"][0].sum() == 2, "shared warm starts are kept"
    assert "residual" in ranks[1]["engine"]["reduction"], "the donor's own state is not modified"


def test_position_keeps_the_fraction_of_the_epoch_and_the_pipeline_gap():
    # 3 ranks, 20 steps/epoch; checkpoint in epoch 1 after 8 of its batches = step 28, 27 updates applied
    # (width 2: one in flight). 2 ranks: 30 steps/epoch; 24,000 samples of epoch 1 trained -> 18 batches left.
    pos = elastic.remap_position(epoch=1, batches_per_epoch=30, batches_left=18, old_step=28, old_scheduler_steps=27)
    assert pos == elastic.Position(step=42, scheduler_steps=41)


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
    from pipesgd.emulate.netns import list_namespaces

    run_dir, before = tmp_path / "run", set(list_namespaces())
    r = run("--run-dir", str(run_dir), "--kill-at-step", "40", "--rejoin-after", "20", "--timeout-s", "540", "--",
            *DRILL, tmp=tmp_path, prefix=("-m", "pipesgd.emulate.drill"), timeout=580)
    assert r.returncode == 0, r.stderr[-4000:]
    d = json.loads((run_dir / "drill.json").read_text())
    assert d["agent_exit_codes"] == {"0": 0, "1": 0, "2": 0}
    assert d["steps_lost"] == d["killed_at_step"] - d["newest_checkpoint_step"] >= 0
    assert "world 3 -> 2 ranks" in d["shrink_line"] and "world 2 -> 3 ranks" in d["grow_line"]
    assert d["seconds_to_first_step"] < 120 and d["seconds_to_rejoin"] < 180
    assert d["world_size"] == 3 and d["test_accuracy"] > 0.9
    assert not tagged_processes(r.tag) and set(list_namespaces()) <= before, "no process or namespace left"


def test_the_accuracy_study_pairs_runs_by_seed(tmp_path):
    """bench/elastic_study.py: the difference is taken per seed, and a missing run leaves a gap, not a 0."""
    from pipesgd.bench import elastic_study as study

    def write(name: str, acc: float, resharded=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"test_accuracy": acc, "resharded": resharded}))

    for seed, ref, ela in ((0, 0.97, 0.96), (1, 0.95, 0.955)):
        write(f"mnist-s{seed}-reference", ref)
        write(f"mnist-s{seed}-elastic", ela, {"old_world": 3, "new_world": 2})
    write("mnist-s2-reference", 0.90)  # its elastic run never finished
    a = study.parse(["--workloads", "mnist", "--seeds", "0,1,2", "--dir", str(tmp_path)])
    row = study.result(a)["workloads"][0]
    assert [r["seed"] for r in row["runs"]["elastic"]] == [0, 1] and len(row["runs"]["reference"]) == 3
    assert row["paired_difference_pp"]["mean"] == pytest.approx((-1.0 + 0.5) / 2)
    assert row["reference"]["min"] == pytest.approx(90.0) and len(row["resharded"]) == 2
    assert "| mnist | 2 |" in study.table(study.result(a))
    with pytest.raises(SystemExit):
        study.parse(["--workloads", "imagenet"])
