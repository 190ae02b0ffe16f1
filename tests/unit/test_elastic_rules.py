"""Elastic resume's rules, without processes: the re-sharding rule (every remaining sample exactly
once), the per-rank state rules, the step/schedule remap, and the accuracy study's pairing
(tests/lab/test_elastic.py runs them end to end)."""

import json

import pytest
import torch

from pipesgd.reliability import elastic
from pipesgd.data.loader import ShardedLoader, Split


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
    from pipesgd import PipeSGD
    from pipesgd.compress import get_compressor

    model = torch.nn.Linear(3, 1)
    # The engine says what a new rank drops: its reduction's declared elastic_drop (the residual).
    with PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(),
                 compressor=get_compressor("int8", error_feedback=True)) as engine:
        migrate = engine.state_for_new_rank
    ranks = [_rank(i) for i in range(3)]
    assert [elastic.rank_state(ranks, r, migrate) is ranks[r] for r in range(2)] == [True, True], "shrink: own state"
    new = elastic.rank_state(ranks, 4, migrate)  # grow to 5: rank 4 takes old rank 1's (4 mod 3)
    assert new["buffers"]["bn"][0] == 1 and new["engine"]["staleness"]["local"][0][0] == 1 and new["new_rank"]
    assert "residual" not in new["engine"]["reduction"], "a residual is owed by its own rank only"
    assert new["engine"]["reduction"]["q"][0].sum() == 2, "shared warm starts are kept"
    assert "residual" in ranks[1]["engine"]["reduction"], "the donor's own state is not modified"


def test_position_keeps_the_fraction_of_the_epoch_and_the_pipeline_gap():
    # 3 ranks, 20 steps/epoch; checkpoint in epoch 1 after 8 of its batches = step 28, 27 updates applied
    # (width 2: one in flight). 2 ranks: 30 steps/epoch; 24,000 samples of epoch 1 trained -> 18 batches left.
    pos = elastic.remap_position(epoch=1, batches_per_epoch=30, batches_left=18, old_step=28, old_scheduler_steps=27)
    assert pos == elastic.Position(step=42, scheduler_steps=41)
