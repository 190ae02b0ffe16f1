"""The sampler at replica level (``dist.ranks_per_replica``): k ranks with batch b see exactly
what one rank with batch k·b sees in the same replica (samples and augmentation draws), at the
epoch's start and after a resume mid-epoch; at k = 1 nothing moves."""

import pytest
import torch

from pipesgd.data.loader import ShardedLoader
from pipesgd.data.split import Split


def _split(n=203):
    g = torch.Generator().manual_seed(3)
    return Split(images=torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), labels=torch.arange(n))


def _replica_batches(split, batch, world, k, replica, consumed=0, augment=True):
    """The batches of ``replica``'s ranks, each step's pieces joined in rank order."""
    loaders = [ShardedLoader(split, batch, replica * k + j, world, seed=5, augment=augment, ranks_per_replica=k)
               for j in range(k)]
    pieces = [list(ld.iter_epoch(1, 0, consumed)) for ld in loaders]
    return [(torch.cat([p[i][0] for p in pieces]), torch.cat([p[i][1] for p in pieces]))
            for i in range(len(pieces[0]))]


@pytest.mark.parametrize("consumed", [0, 48])
@pytest.mark.parametrize("k", [2, 3])
def test_k_ranks_with_batch_b_see_one_rank_with_batch_kb(k, consumed):
    split, b, replicas = _split(), 4, 2
    for m in range(replicas):
        one = _replica_batches(split, k * b, replicas, 1, m, consumed)
        many = _replica_batches(split, b, replicas * k, k, m, consumed)
        assert len(one) == len(many) > 0
        for (x1, y1), (xk, yk) in zip(one, many):
            assert torch.equal(y1, yk) and torch.equal(x1, xk), f"replica {m}"
    # the replicas' shares are disjoint
    seen = [y for m in range(replicas) for _, ys in _replica_batches(split, b, replicas * k, k, m) for y in ys.tolist()]
    assert len(seen) == len(set(seen))


def test_ranks_of_one_replica_take_different_samples_and_k_1_is_todays_sharding():
    split = _split()
    a, b = (ShardedLoader(split, 4, r, 4, seed=5, ranks_per_replica=2) for r in (0, 1))
    assert not set(a.indices(0).tolist()) & set(b.indices(0).tolist())
    # k = 1: rank r takes every world-th index of the permutation from r, as before replicas existed
    from pipesgd.data.loader import mix_seed
    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(mix_seed(5, 0)))
    one = ShardedLoader(split, 4, 1, 3, seed=5)
    assert torch.equal(one.indices(0), order[1::3][: len(one) * 4])
    assert len(one) == len(split) // 3 // 4 and one.batches_left(30) == (len(split) - 30) // 3 // 4


def test_ranks_per_replica_must_divide_the_world():
    with pytest.raises(ValueError, match="ranks_per_replica=3 does not divide world_size=4"):
        ShardedLoader(_split(), 4, 0, 4, seed=5, ranks_per_replica=3)
