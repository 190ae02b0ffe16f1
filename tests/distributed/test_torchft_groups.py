"""trainer.mode=torchft_diloco with replica groups of k ranks (each group a job of its own, as torchft's
recipe builds one: data parallel inside, rank j of each group exchanging with rank j of the others):
two groups of two ranks, each rank half its group's batch, end exactly where two groups of one rank
with the whole batch end (the period-H engine's blocking reference, tests/diloco_reference.py). Four
processes behind a lighthouse in this one, on loopback. Skipped without torchft (pip install
'.[live]'), except under CI=true, where it fails."""

from __future__ import annotations

import os

import pytest
import torch

from needs_torchft import require_torchft

require_torchft()

from diloco_reference import diloco_reference  # noqa: E402
from distributed_utils import free_port  # noqa: E402
from engine_reference import flat_params, make_model  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402
from torchft_diloco_worker import gather, train_in_group  # noqa: E402

GROUPS, RANKS = 2, 2


@pytest.mark.timeout(240)
def test_two_groups_of_two_ranks_train_as_two_groups_of_one_with_the_whole_batch():
    h, steps = 4, 12
    expected = diloco_reference(GROUPS, h, 1, steps, "none")[0]
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum tick at info
    with Lighthouse(LighthouseOptions(min_replicas=GROUPS, join_timeout_ms=60_000)) as lighthouse:
        ports = [free_port() for _ in range(GROUPS)]
        results = {(g, r): rest for g, r, *rest in gather(
            [(train_in_group, g, r, RANKS, ports[g], lighthouse.address, h, steps)
             for g in range(GROUPS) for r in range(RANKS)], timeout_s=180)}
    for (g, r), (glob, local, sent, summary) in sorted(results.items()):
        assert (glob - expected).abs().max() <= 1e-6, f"group {g} rank {r}'s global weights"
        # the group's ranks stepped together (their gradients averaged): the same local weights
        assert torch.equal(local, results[(g, 0)][1]), f"group {g} rank {r} drifted from its rank 0"
        assert summary["group_ranks"] == RANKS and summary["rounds"] == steps // h
        # each rank sends the whole model's pseudo-gradient with its peers in the other group, fp32 ring
        assert sum(sent) == pytest.approx(steps // h * 4 * expected.numel(), rel=1e-6)
    assert not torch.equal(expected, flat_params(make_model())), "the reference trained nothing"
